"""The core layer: jax-free and torch-free, shared by jaxloop and torch_ref (config classes that validate
and build, the command line, errors, record sources and order, run_dir rules, atomic writes)."""
