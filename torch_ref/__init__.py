"""torch_ref: the PyTorch reference training loop of jaxloop, written for clarity first.

One module per jaxloop layer (schedule, optim, precision, models, state, step, data, checkpoint, train),
so torch_ref/x.py reads beside jaxloop/x.py. It imports no jax: only jaxloop.config.run, jaxloop.config.cli and
jaxloop.data.sources (numpy) from jaxloop. See docs/torch-ref-and-parity.md.
"""
