"""The one argv scanner (jaxloop.core.argv) that jaxloop.train, torch_ref.train and jaxloop.schedule read their own
options with, before tyro parses the config's flags."""

from __future__ import annotations

import pytest

from jaxloop.core.argv import take_flag, take_option
from jaxloop.core.errors import UsageError


def test_an_option_is_read_in_either_spelling_and_removed() -> None:
    for argv in (["--steps", "5", "--at", "0,3", "--seed", "1"], ["--steps", "5", "--at=0,3", "--seed", "1"]):
        assert take_option(argv, "--at") == "0,3"
        assert argv == ["--steps", "5", "--seed", "1"]


def test_a_kept_option_stays_in_argv() -> None:
    argv = ["--run_dir", "runs/x", "--steps", "5"]
    assert take_option(argv, "--run_dir", keep=True) == "runs/x"
    assert argv == ["--run_dir", "runs/x", "--steps", "5"]


def test_an_absent_option_is_none_and_argv_unchanged() -> None:
    argv = ["--steps", "5"]
    assert take_option(argv, "--clip") is None and argv == ["--steps", "5"]


def test_an_option_without_its_value_is_a_usage_error_naming_it() -> None:
    with pytest.raises(UsageError, match="^--clip needs a value: torch or optax$"):
        take_option(["--steps", "5", "--clip"], "--clip", allowed="torch or optax")


def test_a_flag_is_found_in_any_of_its_spellings_and_every_occurrence_removed() -> None:
    argv = ["--model.remat", "--steps", "5", "--model.remat"]
    assert take_flag(argv, "--model.remat") and argv == ["--steps", "5"]
    assert not take_flag(argv, "--model.no_remat", "--model.no-remat") and argv == ["--steps", "5"]
