"""The run's configuration: the config tree and its presets, the optimizer and schedule classes, the
field checks, the command line and --config files, the exceptions and exit statuses, the cadence.
Imports no jax and no torch: jaxloop, torch_ref and the CLI all read it."""
