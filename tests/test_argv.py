"""The one argv scanner (jaxloop.config.argv) that jaxloop.train, torch_ref.train and jaxloop.schedule read their own
options with, before tyro parses the config's flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxloop.config.argv import FOREIGN_FLAGS, take_flag, take_option
from jaxloop.config.cli import known_flags, parse_config
from jaxloop.config.errors import UsageError


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


# ----------------------------------------------------------------------------- other loops' flags


def _docs_table() -> dict[tuple[str, str], list[str]]:
    """docs/training.md's "Flags from other loops" table: (jaxloop's flag, meaning) -> their flags."""
    text = (Path(__file__).parent.parent / "docs" / "training.md").read_text(encoding="utf-8")
    section = text.split("### Flags from other loops", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| `--")]
    return {
        (ours.strip("`"), meaning.strip()): [t.strip(" `").removeprefix("--") for t in theirs.split(", ")]
        for theirs, ours, meaning in rows
    }


def test_the_docs_show_the_foreign_flag_table_as_the_code_holds_it() -> None:
    # mutant (an entry added to FOREIGN_FLAGS, not to the docs): the two differ
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, (ours, meaning) in FOREIGN_FLAGS.items():
        grouped.setdefault((ours, meaning), []).append(name)
    assert _docs_table() == grouped


def test_every_foreign_flag_points_at_a_flag_jaxloop_takes() -> None:
    # mutant ("--optim.peak_rl" for learning_rate): not a known flag
    known = known_flags()
    for name, (ours, _) in FOREIGN_FLAGS.items():
        assert ours.split()[0] in known, name
        assert f"--{name}" not in known, f"{name} is jaxloop's own flag"


@pytest.mark.parametrize("theirs", sorted(FOREIGN_FLAGS))
def test_another_loops_flag_is_answered_with_jaxloops_never_a_near_spelling(theirs: str) -> None:
    # mutant (check_flags without foreign_flag): --max_steps gets "did you mean --max_bad_steps?" (the
    # non-finite limit), --lr "(see --help)", --eval_steps "--eval_batches"
    ours, meaning = FOREIGN_FLAGS[theirs]
    with pytest.raises(UsageError) as e:
        parse_config([f"--{theirs}", "1"])
    assert str(e.value) == f"unknown flag --{theirs}; jaxloop's is {ours}: {meaning}"


@pytest.mark.parametrize("spelled", ["--trainer.max_epochs", "--gradient-accumulation-steps", "--bf16"])
def test_lightnings_prefix_hyphens_and_a_bare_switch_are_recognised(spelled: str) -> None:
    # mutant (foreign_flag without removeprefix("trainer.")): --trainer.max_epochs gets "(see --help)"
    with pytest.raises(UsageError, match="; jaxloop's is --"):
        parse_config([spelled])


def test_a_typo_gets_the_closest_flag_compared_without_the_dashes() -> None:
    # mutant (difflib over "--"-prefixed names, as before): "--eval" gets "did you mean --help?" and "--wd"
    # "--seed"; the two dashes every flag shares make any short name look close to a short flag
    with pytest.raises(UsageError, match=r"^unknown flag --stpes; did you mean --steps\?$"):
        parse_config(["--stpes", "5"])
    for name in ("--eval", "--wd"):
        with pytest.raises(UsageError, match=rf"^unknown flag {name} \(see --help\)$"):
            parse_config([name, "5"])
