"""The CLI: `python -m jaxloop.train [--preset NAME] [--config FILE] [--field value ...]`.

Exit status: 0 done (also after early stopping); 1 too many consecutive non-finite updates; 2 bad
input (one line on stderr, nothing written: a bad config, a bad record, a run_dir another run holds;
a bad record met only later, at batching, stops the run with 2 as well); 3 a checkpoint could not be
written, or the disk filled (the last good checkpoint is named, a rerun resumes from it); 4 out of memory in
every plan (jaxloop.memory); 130 / 143 interrupted by SIGINT / SIGTERM after the current call was
finished and saved. See docs/faults.md.
"""

from __future__ import annotations

import errno
import sys

from jaxloop.checkpoint import disk_full_line
from jaxloop.distributed import is_primary
from jaxloop.loop import run
from loopcore.cli import (EXIT_BAD_INPUT, EXIT_CHECKPOINT_WRITE, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY, EXIT_SIGNAL,
                          CheckpointWriteError, Interrupted, NonFiniteError, OutOfMemoryError, parse_or_exit)
from loopcore.config import ConfigError

__all__ = ["main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Parse, build, run; returns the exit status."""
    cfg = parse_or_exit(sys.argv[1:] if argv is None else argv, "jaxloop.train")
    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except CheckpointWriteError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT_WRITE
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        print(f"jaxloop.train: error: {disk_full_line(e, cfg.run_dir)}", file=sys.stderr)
        return EXIT_CHECKPOINT_WRITE
    except OutOfMemoryError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except Interrupted as e:
        print(f"jaxloop.train: {e} received: saved and stopped", file=sys.stderr)
        return EXIT_SIGNAL[e.signum]
    if not is_primary():
        return 0  # process 0 reports
    final = ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
    print(f"done: {summary['final_step']} updates in {summary['wall_time_s']:.1f}s; {final}; "
          f"outputs in {cfg.run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
