"""The loader's worker processes: each dies with the process that started it, and never touches an
accelerator. Run first in every grain worker (`loader_worker_init`); the records themselves come from
jaxloop.data.sources.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

PARENT_WATCH_S = 0.5
"""A loader worker checks this often whether the process that started it is still alive."""


def die_with_parent(interval_s: float = PARENT_WATCH_S) -> threading.Thread:
    """In a worker process: a daemon thread that SIGKILLs this process once its parent is gone (re-parented).

    A main process killed by SIGKILL runs no cleanup, and grain's workers (spawned processes) would live on
    (hundreds of MB each), with multiprocessing's resource tracker and the workers' shared-memory segments
    (the tracker unlinks those once the last worker is gone). PR_SET_PDEATHSIG is tied to the thread that
    started the worker, not the process, hence a watch; it ends with the worker.
    """
    parent = os.getppid()

    def watch() -> None:
        while parent != 1 and os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="jaxloop-parent-watch", daemon=True)
    thread.start()
    return thread


def loader_worker_init(*_: Any) -> None:
    """Run first in every loader worker process: die with the parent, keep off accelerators, absl-flag safe.

    Starts die_with_parent. Sets JAX_PLATFORMS=cpu (and jax's config, if the spawned worker imported jax
    through the parent's main module) so a worker can never initialise a GPU/TPU, and marks absl flags as
    parsed when no one parsed them (scripts not run through absl.app), so flag reads cannot raise in the worker.
    """
    die_with_parent()
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "config"):
        try:
            jax.config.update("jax_platforms", "cpu")
        except Exception:  # noqa: BLE001 - best effort; workers never call jax anyway
            pass
    absl_flags = sys.modules.get("absl.flags")
    if absl_flags is not None and not absl_flags.FLAGS.is_parsed():
        absl_flags.FLAGS.mark_as_parsed()
