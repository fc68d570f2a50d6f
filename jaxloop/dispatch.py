"""Device calls: the compiled train step run n updates at a time on prefetched micro-batches.

The loop talks to the device only through a Dispatcher: `dispatch(state, step, n)` hands the device one
compiled call of n updates (a lax.scan of train_step over K x n micro-batches already on the device, the
state donated) and returns at once; `wait(call)` is where the host waits for it (its per-micro-batch
metrics, fetched once). A call of each size is compiled on first use (`ready(n)` says whether it is)
through a Compiler, which keeps compiled calls of a built-in task on disk (jaxloop.executables). The
Dispatcher is also the test seam of the loop: wrap or subclass it to record or alter the calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxloop.data import DevicePrefetcher
from jaxloop.distributed import pin_shardings
from jaxloop.executables import compile_cached
from jaxloop.runinfo import Timings
from jaxloop.state import TrainState


class Compiler:
    """jitted.lower(*args).compile(), through the store of compiled calls in `directory` (None: no store;
    jaxloop.executables) keyed by the call's name and `fields` (the config's fields that enter the
    computation: loopcore.config.compiled_fields)."""

    def __init__(self, directory: str | None = None, fields: dict[str, Any] | None = None):
        self.directory, self.fields = directory, fields or {}

    def context(self, name: str) -> dict[str, Any]:
        """What, beside jaxloop's sources and the arguments, the call `name` depends on (its store key)."""
        return {"call": name, "config": self.fields}

    def __call__(self, jitted: Any, args: tuple, name: str) -> Any:
        return compile_cached(jitted, args, self.directory, self.context(name))


class Call(NamedTuple):
    """A dispatched call: its output state and stacked metrics (device arrays, maybe not computed yet)
    and the applied update count it started from."""

    state: TrainState
    metrics: dict[str, jax.Array]
    start: int


class Finished(NamedTuple):
    """A call the device has finished: its output state, its per-micro-batch metrics on the host, the
    update counts before (start) and after it (step), when the host had them (synced, perf_counter) and
    the data waits so far (data_wait, seconds)."""

    state: TrainState
    metrics: dict[str, np.ndarray]
    start: int
    step: int
    synced: float
    data_wait: float


class Dispatcher:
    """Runs calls of `steps` (scan_steps(train_step): K x n micro-batches per call of n updates) on the
    micro-batches of `batches` (a DevicePrefetcher of stacked chunks). Compiling a call is timed under
    "compile" and reported to `on_compiled` (the loop's clock leaves it out of the training time)."""

    def __init__(self, steps: Callable[..., Any], batches: DevicePrefetcher, accum_steps: int, compiler: Compiler,
                 timings: Timings, on_compiled: Callable[[], None] = lambda: None):
        self.steps, self.batches, self.accum_steps = steps, batches, accum_steps
        self.compiler, self.timings, self.on_compiled = compiler, timings, on_compiled
        self.compiled: dict[int, Any] = {}

    def ready(self, n: int) -> bool:
        """Whether the call of n updates is compiled (dispatching it would not compile)."""
        return n in self.compiled

    def dispatch(self, state: TrainState, step: int, n: int) -> Call:
        """Dispatch the call of n updates after update `step`; the state is donated to it. Returns at once."""
        chunk = self.batches.take(self.accum_steps * n)
        new_state, metrics = self._compiled(n, state, chunk)(state, chunk)
        return Call(new_state, metrics, step)

    def wait(self, call: Call) -> Finished:
        """The finished call: the host waits here for its metrics (the applied update count with them)."""
        metrics = jax.device_get(call.metrics)
        synced, waited = time.perf_counter(), self.batches.total_wait_s
        return Finished(call.state, metrics, call.start, call.start + int(np.sum(metrics["updated"])), synced, waited)

    def data_state(self) -> dict[str, Any]:
        """The loader's checkpointable position: after the micro-batches dispatched, not those prefetched."""
        return self.batches.state()

    def _compiled(self, n: int, state: TrainState, chunk: Any) -> Any:
        """The call running n updates, compiled on first use (its own compile time is timed)."""
        if n not in self.compiled:
            with self.timings("compile"):
                # jit with the state donated and returned in its own shardings (jaxloop.distributed)
                self.compiled[n] = self.compiler(pin_shardings(self.steps, state, donate=True), (state, chunk),
                                                 f"train x{n}")
            self.on_compiled()
        return self.compiled[n]
