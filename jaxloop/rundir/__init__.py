"""The run directory: its layout, the start and resume rules, the lock, atomic writes, metrics records,
the outcome (summary.json) and the model's identity (model.json). Imports no jax and no torch."""
