"""The CLI: `python -m jaxloop.train [--preset NAME] [--config FILE] [--field value ...]`.

Exit status (loopcore.cli, the same for torch_ref.train): 0 done (also after early stopping); 1 too many
consecutive non-finite updates; 2 bad input (one line on stderr, nothing written); 130 / 143 interrupted
by SIGINT / SIGTERM after the current call was finished and saved.
"""

from __future__ import annotations

import sys

from jaxloop.runner import run
from loopcore.cli import finish, parse_or_exit

__all__ = ["main", "run"]


def main(argv: list[str] | None = None) -> int:
    """Parse, build, run; returns the exit status."""
    cfg = parse_or_exit(sys.argv[1:] if argv is None else argv, "jaxloop.train")

    def announce() -> bool:
        from jaxloop.distributed import is_primary

        return is_primary()  # process 0 reports

    return finish("jaxloop.train", cfg, lambda: run(cfg), announce=announce)


if __name__ == "__main__":
    sys.exit(main())
