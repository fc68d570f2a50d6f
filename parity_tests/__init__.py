"""parity_tests: jaxloop against torch_ref, its PyTorch reference loop, number by number.

`python -m pytest parity_tests` runs the checks and prints each one's measured difference beside its
tolerance; `python -m parity_tests.report` runs them and writes PARITY.md with plots;
`python -m parity_tests.convert --from torch|jax SRC_RUN_DIR DST_RUN_DIR` moves a checkpoint between
the two loops.
"""
