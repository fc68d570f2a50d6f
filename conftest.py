"""What both suites (tests/, parity_tests/) share: JAX's persistent compilation cache for the session.

The suites compile the same programs many times: every in-process `jaxloop.run`, port check and parity
configuration traces anew, and the `python -m jaxloop.train` children compile the built-in tasks with the
command's default --compile_cache. With the in-process compiles pointed at that same directory, a program
compiled once anywhere in the session is loaded after that, as a user's second run loads it. A test that
gives a run its own compile_cache still gets that directory for the run (jaxloop.loop.process); a test that
needs the cache off runs a child with `--compile_cache ""`. JAX's settings are put back when the session
ends. Results do not depend on it: a loaded executable is the one compiled (tests/test_train.py checks the
bits of a run that loaded every call).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_for_the_session() -> Iterator[Path]:
    from jaxloop.core.config import Config
    from jaxloop.loop.compilation import compilation_cache

    with compilation_cache(Path(Config().compile_cache).expanduser()) as directory:
        yield directory
