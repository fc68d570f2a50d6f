"""What a run shows: progress and metrics sinks, run metadata and timings, the end-of-run report."""
