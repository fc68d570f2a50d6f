"""`python -m jaxloop.report RUN_DIR`: write RUN_DIR/report.md and its plots (jaxloop.observe.run_report).

Exit status 2 (one line on stderr) when RUN_DIR is not a run directory. Imports no jax.
"""

from __future__ import annotations

import argparse
import sys

from jaxloop.config.errors import EXIT_BAD_INPUT
from jaxloop.observe.run_report import NotARunError, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxloop.report", description="Write RUN_DIR/report.md and its plots.")
    parser.add_argument("run_dir", help="a jaxloop run directory (finished, resumed or killed)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.run_dir)
    except NotARunError as e:
        print(f"jaxloop.report: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
