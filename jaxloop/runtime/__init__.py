"""Process-wide settings for the length of a run, never at import: signals, the compilation cache,
deterministic kernels, the host allocator, the run's processes, and their composition (settings.py)."""
