"""loopcore: what both training loops share, with no jax and no torch.

config (the config tree, presets, validation), cli (command line and exit statuses), sources (record
sources and the documented record order), records (metrics records and the best-metric tracker),
run_dir (the run directory's files and its start/resume rules). jaxloop and torch_ref import it;
it imports neither.
"""
