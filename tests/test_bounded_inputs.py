"""Every input bounded (issue 43): a --config file's YAML aliases, and every value an error message shows
(jaxloop.config.errors.short_repr), so that a hostile or mistaken input is one short line at once, however
large it is or expands to."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.config.cli import parse_config
from jaxloop.config.errors import VALUE_SHOWN, short_repr
from jaxloop.config.run import ConfigError

MEMORY_CAP = 2 << 30
"""The address space the CLI's process gets in these tests: parsing a config needs a fraction of it; an
expansion of a few hundred bytes of YAML to billions of values (printed or walked) needs tens of GiB."""


def _alias_bomb(path: Path, levels: int) -> Path:
    """A small YAML file whose one field's aliases nest `levels` times 9 wide: over 9**(levels + 1) strings
    once followed."""
    lines = ["lols:", '  - &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli_in_a_memory_cap(*argv: str) -> subprocess.CompletedProcess:
    """jaxloop.train as a user starts it, its address space capped at MEMORY_CAP (the work an input causes
    is bounded by that, not by a time: the test asserts on no clock)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.train", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        preexec_fn=cap,
    )


def test_a_yaml_alias_bomb_is_refused_in_one_line_naming_the_file(tmp_path):
    # 9 levels in ~500 bytes: 9**10 (3.5 billion) values once followed. Mutant seen failing: yaml.safe_load as
    # before (the unknown field's message printed the whole expansion: MemoryError under the cap, a traceback)
    bomb = _alias_bomb(tmp_path / "bomb.yaml", levels=9)
    assert bomb.stat().st_size < 600
    out = _cli_in_a_memory_cap("--config", str(bomb), "--run_dir", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"jaxloop.train: error: --config='{bomb}' is not allowed: a YAML file of at most 100,000 values once its "
        "aliases are followed (a config has a few hundred; these aliases expand beyond that)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.yaml"]


def test_yaml_aliases_within_the_bound_still_load(tmp_path):
    # a config that shares a section by an alias is no bomb (mutant: a limit on alias uses of 1 refuses it)
    f = tmp_path / "run.yaml"
    f.write_text("preset: debug\noptim: &o {peak_lr: 0.004}\nsteps: &s 7\neval_every: *s\n")
    cfg = parse_config(["--config", str(f), "--run_dir", str(tmp_path / "r")], check_paths=False)
    assert (cfg.steps, cfg.eval_every, cfg.optim.peak_lr) == (7, 7, 0.004)


def test_an_error_shows_a_few_hundred_characters_of_a_large_value(tmp_path):
    # 4 levels (66,430 values) are within the bound, and the unknown field's
    # message shows its value cut (mutant seen failing: ConfigError printing {value!r}: a 472 KB line)
    f = _alias_bomb(tmp_path / "wide.yaml", levels=4)
    with pytest.raises(ConfigError) as refused:
        parse_config(["--config", str(f), "--run_dir", str(tmp_path / "r")], check_paths=False)
    message = refused.value.cli_message
    assert message.startswith("lols=[['lol', 'lol'") and f"... (cut at {VALUE_SHOWN} characters)" in message
    shown = message.split(" is not allowed: ")[0].removeprefix("lols=")
    assert len(shown) == VALUE_SHOWN + len(f"... (cut at {VALUE_SHOWN} characters)")


@pytest.mark.parametrize(
    "value",
    [
        0,
        "a",
        [],
        [1, "b"],
        (1,),
        (1, 2),
        {},
        {"b": 1, "a": [1, (2,)]},
        {3},
        frozenset({1}),
        2**40,
        1.5,
        None,
        True,
        b"x",
    ],
)
def test_short_repr_is_repr_for_a_small_value(value):
    assert short_repr(value) == repr(value)


def test_short_repr_is_bounded_for_any_value():
    # the work is bounded by the characters shown: a cyclic list, a 10**6 character string, an integer whose
    # repr Python refuses (over 4300 digits), 9**10 values sharing one list
    cyclic: list = []
    cyclic.append(cyclic)
    nested: list = ["lol"] * 9
    for _ in range(9):
        nested = [nested] * 9
    for value in (cyclic, "x" * 10**6, 10**5000, nested):
        shown = short_repr(value)
        assert len(shown) <= VALUE_SHOWN + len(f"... (cut at {VALUE_SHOWN} characters)"), shown
    assert short_repr(10**5000) == "<an integer of 16610 bits>"


def test_data_workers_beyond_what_the_machine_runs_are_refused_naming_the_range(tmp_path):
    # mutant seen failing: no upper bound (200 workers on 2 cores trained nothing in 90 s; 100000 left semaphores)
    from jaxloop.config.run import WORKERS_PER_CORE, usable_cores

    most = WORKERS_PER_CORE * usable_cores()
    assert parse_config(["--data.workers", str(most), "--run_dir", str(tmp_path)]).data.workers == most
    with pytest.raises(ConfigError) as refused:
        parse_config(["--data.workers", str(most + 1), "--run_dir", str(tmp_path)])
    assert refused.value.cli_message == (
        f"data.workers={most + 1} is not allowed: an integer in [0, {most}] ({WORKERS_PER_CORE} per CPU core this "
        f"process may use: {usable_cores()}; each worker is a process of its own)"
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_process_whose_peer_never_comes_ends_in_one_line_naming_it(tmp_path):
    # after distributed.peer_timeout_s, one line naming the missing process_id and what to do, exit 2, nothing
    # in run_dir. Mutant seen failing: the timer removed (jax's own timeout: a C++ abort, exit 134, 14 lines)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run_dir = tmp_path / "r"
    argv = ["--preset", "debug", "--run_dir", str(run_dir), "--distributed.num_processes", "2"]
    argv += ["--distributed.coordinator", f"localhost:{port}", "--distributed.peer_timeout_s", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"distributed: process 0 waiting for all 2 processes at the coordinator localhost:{port} (up to 3 s)",
        f"jaxloop.train: error: distributed: process 0 waited 3 s at the coordinator localhost:{port} for all 2 "
        "processes; missing among process_id 1: start each with the same --distributed.* flags and its own "
        "--distributed.process_id (or raise --distributed.peer_timeout_s)",
    ]
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_process_waiting_for_its_peers_says_so_at_once(tmp_path):
    # the first line on stderr names the wait, before it (mutant seen failing: no line; the first one came from
    # jax's error after its timeout). The process is stopped once the line is read: no clock is asserted on.
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--preset",
            "debug",
            "--run_dir",
            str(tmp_path / "r"),
            "--distributed.num_processes",
            "2",
            "--distributed.coordinator",
            f"localhost:{port}",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        first = proc.stderr.readline().strip()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert first == (
        f"distributed: process 0 waiting for all 2 processes at the coordinator localhost:{port} (up to 300 s)"
    )


def test_a_long_value_in_a_flag_tyro_refuses_is_shown_cut(tmp_path):
    # mutant seen failing: tyro's message passed on whole (a 3,191-character line for a 3,000-character value)
    from jaxloop.config.cli import UsageError

    with pytest.raises(UsageError) as refused:
        parse_config(["--precision", "a" * 3000, "--run_dir", str(tmp_path)])
    message = str(refused.value)
    assert f"... (cut at {VALUE_SHOWN} characters)' for argument '--precision'. Expected one of" in message
    assert len(message) < VALUE_SHOWN + 250


def _peak_rss_until_first_update(argv: list[str], cap: int) -> tuple[int, int, list[str]]:
    """Run jaxloop.train with `argv` until its first progress line, then SIGTERM it; the process's RSS is polled
    on the way and the run killed once it passes `cap`. Returns (peak bytes, exit status, output lines)."""
    import signal
    import threading

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxloop.train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    updated = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("update "):
                updated.set()
        updated.set()  # the stream ended: nothing more to wait for

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = 0
    watched = psutil.Process(proc.pid)
    try:
        while not updated.wait(0.2):
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if peak > cap:
                proc.kill()
                break
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=60)
    return peak, status, lines


def test_a_run_of_the_most_steps_allowed_reaches_its_first_update_in_bounded_memory(tmp_path):
    # config.MAX_STEPS's doc: the schedule's table costs about 60 MiB per million updates (measured 981 MiB at the
    # bound for the debug preset, 370 MiB for 100 steps). The cap, 1.5 GiB, is that plus half a GiB of margin; the
    # run is stopped by SIGTERM at its first update (no clock asserted on). Mutant seen failing: MAX_STEPS back at
    # 100,000,000 (issue 43: 8.1 GB before the first update; killed here past the cap)
    from jaxloop.config.run import MAX_STEPS

    argv = ["--preset", "debug", "--run_dir", str(tmp_path / "r"), "--steps", str(MAX_STEPS), "--log.progress", "plain"]
    peak, status, lines = _peak_rss_until_first_update(argv, cap=3 << 29)
    assert peak <= 3 << 29, f"{peak >> 20} MiB before the first update"
    assert any(line.startswith(f"update 1/{MAX_STEPS} ") for line in lines), lines[-5:]
    assert status == 143, lines[-5:]
