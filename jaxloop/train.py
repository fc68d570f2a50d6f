"""The CLI: `python -m jaxloop.train [--preset NAME] [--config FILE] [--field value ...]`.

Exit status (jaxloop.config.cli, the same for torch_ref.train): 0 done (also after early stopping); 1 too many
consecutive non-finite updates; 2 bad input (one line on stderr, nothing written: a bad config, a bad record,
a run_dir another run holds; a bad record met later, at batching, stops the run with 2 too); 3 a checkpoint
could not be written, or the disk filled (the last good checkpoint is named: a rerun resumes from it); 4
out of memory in every plan (jaxloop.update.memory_plan); 130 / 143 interrupted by SIGINT / SIGTERM after the current
call was finished and saved. docs/faults.md lists every fault.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from jaxloop.config.cli import EXIT_SIGNAL, finish, parse_or_exit
from jaxloop.runtime.signals import cli_session

__all__ = ["end_process", "main", "run"]  # noqa: F822  (run: the module's __getattr__, imported on first use)

PROG = "jaxloop.train"


def main(argv: list[str] | None = None) -> int:
    """Parse, build, run; returns the exit status. Ctrl-C is answered from the first line (jaxloop.runtime.signals):
    jax is imported inside the session, so that even an interrupted import ends in one line."""
    with cli_session(PROG):
        try:
            cfg = parse_or_exit(sys.argv[1:] if argv is None else argv, PROG)
            from jaxloop.loop.runner import run

            def announce() -> bool:
                from jaxloop.runtime.processes import is_primary

                return is_primary()  # process 0 reports

            return finish(PROG, cfg, lambda: run(cfg), announce=announce)
        except KeyboardInterrupt:  # raised by code of its own (the session's handler raises none): one line
            print(f"{PROG}: interrupted: stopped", file=sys.stderr)
            return EXIT_SIGNAL[signal.SIGINT]


def __getattr__(name: str) -> Any:
    """`jaxloop.train.run` (jaxloop.loop.runner.run), imported on first use: `python -m jaxloop.train` imports
    jax only once its Ctrl-C handling is in place."""
    if name == "run":
        from jaxloop.loop.runner import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def end_process(status: int) -> None:
    """The command's last act: its one line is out; a fault ends the process here, flushed, without waiting
    for threads a failure left behind (Orbax's commit threads of a failed save wait for its step directory up
    to Orbax's 300 s timeout) or finalizing what they abandoned; a finished run exits as usual."""
    if status:
        sys.stdout.flush()
        sys.stderr.flush()
        if "jax" in sys.modules:  # a run that started jax: its peers first (imported here: jax is loaded already)
            from jaxloop.runtime.processes import leave

            leave()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    end_process(main())
