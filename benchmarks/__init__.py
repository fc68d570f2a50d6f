"""jaxloop's benchmarks: `python -m benchmarks` (see benchmarks/__main__.py); bench_data.py and
bench_checkpoint.py also run on their own. What each row measures and the findings behind the numbers:
docs/benchmark-notes.md (copied into BENCHMARKS.md below its tables)."""
