"""The first hour of a new user (issue 39): resume by name, a finished run re-run, the done line, typos
answered with "did you mean", --help, and the plots of a run shorter than log_every."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

from jaxloop import Config, Hook, run
from jaxloop.config.cli import UsageError, parse_config
from jaxloop.config.run import ConfigError
from jaxloop.observe.run_report import load_run, plot_loss, plot_throughput
from jaxloop.train import main

# A tiny run: the debug preset's MLP, 6 updates, a checkpoint every 3, no TensorBoard (speed).
FLAGS = [
    "--preset",
    "debug",
    "--steps",
    "6",
    "--checkpoint.every",
    "3",
    "--eval_every",
    "3",
    "--log.no_tensorboard",
    "--log.progress",
    "off",
]


def _cli(*argv: str) -> tuple[int, str]:
    """jaxloop.train's main in this process: its exit status and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, err.getvalue()


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The tiny run, stopped by a hook after update 3 (saved there, as a Ctrl-C leaves it). Tests copy it."""
    run_dir = tmp_path_factory.mktemp("stopped") / "r"
    cfg = parse_config([*FLAGS, "--run_dir", str(run_dir)])
    run(cfg, hooks=[Hook(lambda info: info.stop("signal SIGINT"), every=3)])
    return run_dir


@pytest.fixture(scope="module")
def resumed(stopped, tmp_path_factory):
    """A copy of `stopped` resumed by name from the command line, with flags a resume may change (the report
    on, another log_every: not the digits defaults either): its directory, exit status and stderr."""
    run_dir = tmp_path_factory.mktemp("resumed") / "r"
    shutil.copytree(stopped, run_dir)
    status, err = _cli("--run_dir", str(run_dir), "--log.report", "--log_every", "2")
    return run_dir, status, err


def _snapshot(run_dir) -> dict[str, tuple[bytes, int]]:
    """Every file under run_dir: its bytes and its modification time (ns)."""
    return {
        str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_run_dir_alone_resumes_the_saved_run_from_the_command_line(resumed):
    # mutant (parse_config ignores the saved config: the digits defaults): exit 2, 12 fields "changed"
    run_dir, status, err = resumed
    assert status == 0, err
    assert "resuming from update 3 " in err
    assert "done: 3 updates this time (6 in all) in " in err
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6


def test_config_with_only_run_dir_resumes_the_saved_run_from_python(stopped, tmp_path):
    # mutant (run() without resume_by_name): a digits run of 500 updates refused for 12 changed fields
    shutil.copytree(stopped, tmp_path / "r")
    summary = run(Config(run_dir=str(tmp_path / "r")))
    assert summary["final_step"] == 6 and summary["updates_this_run"] == 3


def test_flags_given_on_a_resume_by_name_are_checked_against_the_saved_config(stopped):
    status, err = _cli("--run_dir", str(stopped), "--seed", "1")  # refused: nothing written
    assert status == 2
    assert "these fields differ: seed: 0 -> 1. " in err  # only the flag given, not the preset's other defaults


def test_a_resume_conflict_is_refused_before_the_data_is_read(stopped, monkeypatch):
    # issue 45.7: the conflict came after loading the data (3.5-12.8 s, against 0.3 s for a typo). The data
    # source's loader is counted, not timed. Mutant seen failing: rd.check after builtin_task (one load)
    import jaxloop.loop.task as task_module

    loads = []
    load_splits = task_module.load_splits
    monkeypatch.setattr(task_module, "load_splits", lambda cfg: loads.append(cfg) or load_splits(cfg))
    status, err = _cli("--run_dir", str(stopped), "--seed", "1")
    assert status == 2 and "these fields differ: seed: 0 -> 1. " in err
    assert loads == [], "the data source was read before the refusal"


def test_a_finished_run_re_run_says_it_is_complete_and_rewrites_nothing(resumed, tmp_path):
    # mutant (no RunDir.finished check): the run resumes at its end and rewrites summary.json, metrics.jsonl...
    shutil.copytree(resumed[0], tmp_path / "r")
    before = _snapshot(tmp_path / "r")
    status, err = _cli("--run_dir", str(tmp_path / "r"))
    assert status == 0
    final = json.loads((tmp_path / "r" / "summary.json").read_text())["final"]
    assert err.strip() == (
        f"already complete: this run ended at update 6 (completed); "
        f"val_loss {final['val_loss']:.4f}, val_acc {final['val_acc']:.4f}; "
        f"report: {tmp_path / 'r' / 'report.md'}"
    )
    assert _snapshot(tmp_path / "r") == before  # every file byte-identical, mtimes too


def test_a_steps_change_that_moves_the_rate_is_warned_about(resumed, tmp_path):
    # mutant (steps_change_line returns None): no warning
    shutil.copytree(resumed[0], tmp_path / "r")
    status, err = _cli("--run_dir", str(tmp_path / "r"), "--steps", "9", "--allow_steps_change")
    assert status == 0
    assert "warning: steps 6 -> 9 moves the learning rate at update 6: " in err
    assert "done: 3 updates this time (9 in all)" in err


def test_a_mistyped_flag_gets_did_you_mean_and_its_value_is_not_an_option():
    # mutant (no check_flags): tyro's "Unrecognized options: --optim.peak_rl, 3e-3"
    with pytest.raises(UsageError) as e:
        parse_config(["--optim.peak_rl", "3e-3"])
    assert str(e.value) == "unknown flag --optim.peak_rl; did you mean --optim.peak_lr?"


def test_a_mistyped_config_file_key_gets_did_you_mean(tmp_path):
    # mutant (the former message, every field listed): fails on the list
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  peak_rl: 0.003\n")
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(f)])
    assert str(e.value) == "optim.peak_rl=0.003 is not allowed: a known field; did you mean optim.peak_lr?"


def test_help_lists_config_and_says_nothing_stale(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--config FILE" in text and "--run_dir DIR  alone resumes" in text
    assert "JAX_ENABLE_X64" not in text  # fp64 turns x64 on by itself (jaxloop.runtime.settings)


def test_a_run_shorter_than_log_every_draws_its_losses_and_step_times(tmp_path):
    # The README's case: 20 updates under log_every 25 log one record, the last; a line of one point
    # draws nothing. Mutant (no marker on short series): both asserts on markers fail.
    cfg = parse_config([*FLAGS, "--run_dir", str(tmp_path / "r"), "--log_every", "25"])
    run(cfg)
    r = load_run(tmp_path / "r")
    train_line = next(
        ln for ln in plot_loss(r, tmp_path / "loss.png", {}).axes[0].lines if ln.get_label().startswith("train loss")
    )
    assert len(train_line.get_xdata()) == 1 and train_line.get_marker() not in (None, "None", "", " ")
    step_time = plot_throughput(r, tmp_path / "tp.png").axes[1].lines[0]
    assert len(step_time.get_xdata()) == 1 and step_time.get_marker() not in (None, "None", "", " ")


def test_the_schedule_plot_title_fits_the_figure(tmp_path):
    # the longest description (one_cycle's) in 8-point type; mutant (title_lines returns the text as is): clipped
    from jaxloop.update.schedules import plot_schedule

    cfg = parse_config(["--optim.schedule", "one_cycle", "--optim.three_phase"], check_paths=False)
    fig = plot_schedule(cfg.optim, cfg.steps, str(tmp_path / "s.png"))
    title = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= title.x0 and title.x1 <= fig.bbox.x1, (title, fig.bbox)


class _Run:
    """What SignalStop reads of the run: the run_dir and a logger taking messages."""

    run_dir = "runs/x"

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.logger = self

    def message(self, text: str) -> None:
        self.messages.append(text)


def test_a_second_ctrl_c_under_the_cli_ends_at_once(monkeypatch):
    # the watcher's two calls, as two ^C give them; mutant (no second-signal branch): no exit
    import signal

    from jaxloop.loop import actions
    from jaxloop.runtime.signals import Session

    exits = []
    session = Session()
    monkeypatch.setattr(session, "exit", lambda status, line: exits.append((status, line)))
    stop, run_ctx = actions.SignalStop(), _Run()
    stop._run, stop.session, stop.trained, stop.finished, stop.stops_after = run_ctx, session, True, 30, 40
    stop._acknowledge(signal.SIGINT)
    assert (
        run_ctx.messages
        == [
            "SIGINT received: finishing updates 31-40, then stopping after update 40: saving...; "
            "Ctrl-C again to stop at once without saving"
        ]
        and exits == []
    )
    stop._acknowledge(signal.SIGINT)
    assert exits == [
        (
            130,
            "second SIGINT: stopped at once without saving (the run resumes from its last "
            "checkpoint); resume with: python -m jaxloop.train --run_dir runs/x",
        )
    ]


def test_fsdp_beyond_one_cpu_device_names_xla_flags():
    # mutant (cpu_devices_hint returns ""): the message says "one of 1" and nothing more
    import jax

    from jaxloop.update.distributed import check_divisible

    if jax.device_count() != 1 or jax.default_backend() != "cpu":
        pytest.fail("this test process must see one CPU device (tests run without XLA_FLAGS device counts)")
    with pytest.raises(ConfigError) as e:
        check_divisible(parse_config(["--distributed.fsdp", "2"], check_paths=False))
    assert str(e.value) == (
        "distributed.fsdp=2 is not allowed: a divisor of the device count (1): one of 1 (on a "
        "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 before the command gives 2 CPU "
        "devices)"
    )


def test_an_invocation_that_ran_no_update_keeps_the_former_wall_time_and_rate():
    # a run resumed at its end (killed after its last save, before its summary) ran 0 updates: its own wall
    # time (1.4 s) and rate (0) would replace the run's; mutant (summary returned as is): fails
    from jaxloop.loop.runner import keep_timing_of_updates

    previous = {"final_step": 500, "wall_time_s": 2.88, "updates_per_s": 310.0, "timings_s": {"compile": 0.8}}
    now = {"final_step": 500, "updates_this_run": 0, "wall_time_s": 1.45, "updates_per_s": 0.0, "timings_s": {}}
    kept = keep_timing_of_updates(now, previous)
    assert (kept["wall_time_s"], kept["updates_per_s"], kept["timings_s"]) == (2.88, 310.0, {"compile": 0.8})
    ran = {**now, "updates_this_run": 100}
    assert keep_timing_of_updates(ran, previous) == ran  # an invocation that trained reports its own


# ----------------------------------------------------------------------------- the first hour, second pass


def test_the_preset_help_names_every_preset(capsys):
    # mutant (the former doc, "digits, shakespeare or debug"): gpt2-small is missing
    from jaxloop.config.run import PRESETS

    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    preset_help = text.split("--preset STR", 1)[1].split("(default: digits)", 1)[0]
    assert all(name in preset_help for name in PRESETS), preset_help


def test_the_schedule_menu_gives_each_entry_its_whole_first_sentence(capsys):
    # mutant (the docstring's first line, as before): plateau's entry ends at "checkpoint.best_metric, by"
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert (
        "plateau: ReduceLROnPlateau (optim.schedule=plateau): at each evaluation checkpoint.best_metric, by "
        "checkpoint.best_mode, decides whether the rate is multiplied by `factor` (torch's rule and names)" in text
    )


def test_the_schedule_commands_help_is_its_own(capsys):
    # mutant (parse_config without the description: the train command's): "Train a jaxloop run." in it
    from jaxloop.schedule import main as schedule_main

    with pytest.raises(SystemExit) as e:
        schedule_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "Train a jaxloop run" not in text
    assert text.split("\n\n", 1)[1].startswith("python -m jaxloop.schedule [--at U,U,...]")


def test_a_broken_yaml_file_is_answered_with_its_line(tmp_path):
    # mutant (the parser's first line of message only): "while parsing a flow sequence", no line
    f = tmp_path / "run.yaml"
    f.write_text("steps: 5\noptim:\n  peak_lr: 1e-3\n  milestones: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(f)])
    assert "valid YAML or JSON (line 5, column 5: expected ',' or ']', but got ':')" in str(e.value), str(e.value)


def test_a_flat_dotted_key_in_a_config_file_is_told_to_nest(tmp_path):
    # mutant (no dotted-key check): "optim.peak_lr=0.001 is not allowed: a known field of the config (...)"
    f = tmp_path / "run.yaml"
    f.write_text("steps: 5\noptim.peak_lr: 0.001\n")
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(f)])
    assert str(e.value) == (
        f"optim.peak_lr=0.001 is not allowed: in --config {f}, nest it under its section "
        "(optim:, then '  peak_lr: 0.001' on the next line): a file's keys are not dotted"
    )


def test_sigterms_acknowledgement_offers_no_ctrl_c():
    # mutant (the former line whatever the signal): "; Ctrl-C again to stop at once without saving" after SIGTERM
    import signal

    from jaxloop.loop import actions
    from jaxloop.runtime.signals import Session

    stop, run_ctx = actions.SignalStop(), _Run()
    stop._run, stop.session, stop.trained, stop.finished, stop.stops_after = run_ctx, Session(), True, 30, 40
    stop._acknowledge(signal.SIGTERM)
    assert run_ctx.messages == ["SIGTERM received: finishing updates 31-40, then stopping after update 40: saving..."]


def test_the_line_that_ends_the_process_at_once_starts_a_line_of_its_own_on_a_terminal(monkeypatch):
    # a progress bar holds the terminal's line without a newline; mutant (no leading newline on a tty): the
    # second Ctrl-C's line is glued to the bar
    import os

    from jaxloop.runtime import signals as interrupt

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, exits = Terminal(), []
    terminal.write(" 40%|####      | 200/500")
    monkeypatch.setattr(interrupt.sys, "stderr", terminal)
    monkeypatch.setattr(os, "_exit", exits.append)
    interrupt.exit_now(130, "second SIGINT: stopped at once")
    assert terminal.getvalue().splitlines()[-1] == "second SIGINT: stopped at once" and exits == [130]


def test_a_runs_silences_are_announced_and_its_last_line_times_the_process(tmp_path):
    # each stage of seconds says what it is (no timings asserted); mutants seen failing: no say() around the
    # state, no FirstCallAnnounced around the evaluator, no say() around the report, done_line without the
    # process's time
    status, err = _cli(*FLAGS, "--log.report", "--run_dir", str(tmp_path / "r"))
    lines = err.splitlines()
    assert status == 0, err

    def at(start: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(start))

    assert at("creating the state...") < at("the state is ready (") < at("compiling the training call")
    assert (
        at("compiling the training call") < at("compiling the evaluation...") < at("compiled and ran the evaluation (")
    )
    assert (
        at("compiled and ran the evaluation (") < at("writing the report...") < at("wrote the report (") < at("done: ")
    )
    assert " of it in jaxloop.run); " in lines[at("done: ")]
