"""`python -m jaxloop.schedule`: print (or plot) the learning rate a train command's config would apply,
without training (the schedules themselves: jaxloop.update.schedules)."""

from __future__ import annotations

import sys

from jaxloop.config.schedules import PlateauConfig
from jaxloop.update.schedules import describe, plot_schedule, rates, shown_updates

EXPLORER_HELP = """python -m jaxloop.schedule [--at U,U,...] [--plot FILE.png] [the train command's flags]

Prints the learning rate the train command's config would apply at chosen updates (default: a dozen,
with each phase's boundaries), or with --plot also draws every update's rate to FILE.png, without
training. Every flag of `python -m jaxloop.train` is accepted (--optim.schedule one_cycle --steps 1000 ...).
"""


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxloop.schedule`: print (and plot) the schedule of a train command's config."""
    from jaxloop.config.argv import take_option
    from jaxloop.config.cli import EXIT_BAD_INPUT, UsageError, parse_config
    from jaxloop.config.run import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        at, plot = take_option(argv, "--at"), take_option(argv, "--plot")
        cfg = parse_config(argv, "jaxloop.schedule", check_paths=False, description=EXPLORER_HELP)
        updates = shown_updates(cfg.optim, cfg.steps)
        if at is not None:
            try:
                updates = [int(x) for x in at.split(",") if x.strip()]
            except ValueError:
                raise ConfigError("--at", at, "comma-separated update indices (0-based)") from None
            if not updates or min(updates) < 0:
                raise ConfigError("--at", at, "comma-separated update indices >= 0")
    except (ConfigError, UsageError) as e:
        print(f"jaxloop.schedule: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    table = rates(cfg.optim, cfg.steps)
    print(describe(cfg.optim, cfg.steps))
    if isinstance(plateau := cfg.optim.lr_schedule, PlateauConfig):
        print(
            f"(plateau: peak_lr until an evaluation without improvement for more than {plateau.patience} "
            f"evaluations multiplies it by {plateau.factor}; shown before any reduction)"
        )
    print(f"{'update':>8}  rate")
    for u in updates:
        print(f"{u:>8}  {table[min(u, cfg.steps)]:.6g}")
    if plot:
        plot_schedule(cfg.optim, cfg.steps, plot)
        print(f"plotted to {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
