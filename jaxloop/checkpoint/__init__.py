"""Checkpoints: Orbax's rotating manager, the one restore path, --init_from."""
