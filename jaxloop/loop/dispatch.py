"""Device calls: the compiled train step run n updates at a time on prefetched micro-batches.

The loop talks to the device only through a Dispatcher: `dispatch(state, step, n)` hands the device one
compiled call of n updates (a lax.scan of train_step over K x n micro-batches already on the device, the
state donated) and returns at once; `wait(call)` is where the host waits for it (its per-micro-batch
metrics, fetched once). A call of each size is compiled on first use (`ready(n)` says whether it is; JAX's
persistent cache, when on, answers a compile a former run did: jaxloop.runtime.compilation). Given a
memory plan (jaxloop.update.memory_plan), each call is fitted to the device's memory before it first runs: a call that
does not fit is compiled again under a smaller plan (`memory`, then, is that plan). What a call computes
is one record (CallPlan), who hears of its compiling another (CallEvents). The Dispatcher is also the test
seam of the loop: wrap or subclass it to record or alter the calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxloop.config.run import MemoryConfig
from jaxloop.data.pipeline import DevicePrefetcher
from jaxloop.observe.runinfo import Timings
from jaxloop.runtime.compilation import loaded_from_cache
from jaxloop.update.distributed import pin_shardings
from jaxloop.update.memory_plan import Fit, fit
from jaxloop.update.state import TrainState


class Call(NamedTuple):
    """A dispatched call: its output state and stacked metrics (device arrays, maybe not computed yet),
    the applied update count it started from and when it was handed to the device (perf_counter, after
    any compiling)."""

    state: TrainState
    metrics: dict[str, jax.Array]
    start: int
    launched: float = 0.0


class Finished(NamedTuple):
    """A call the device has finished: its output state, its per-micro-batch metrics on the host, the
    update counts before (start) and after it (step), when the host had them (synced, perf_counter) and
    the data waits so far (data_wait, seconds), and how long the device took over it (seconds: from its
    launch, or from the call before it when it was queued behind that one, to its metrics on the host)."""

    state: TrainState
    metrics: dict[str, np.ndarray]
    start: int
    step: int
    synced: float
    data_wait: float
    seconds: float = 0.0

    def applied(self) -> np.ndarray:
        """The state's update count after each micro-batch of the call (skipped updates do not count)."""
        return self.start + np.cumsum(self.metrics["updated"])


@dataclass(frozen=True)
class CallPlan:
    """What a call of the loop computes: `steps_of(memory)` builds the scanned train step under a memory
    plan (scan_steps(train_step): K x n micro-batches per call of n updates); `memory` is the plan to start
    from (None: the call is not fitted to the device's memory); batch_size and blocks bound the plans tried
    (jaxloop.update.memory_plan.candidates)."""

    steps_of: Callable[[MemoryConfig | None], Any]
    accum_steps: int
    memory: MemoryConfig | None = None
    batch_size: int = 0
    blocks: bool = False


@dataclass(frozen=True)
class CallEvents:
    """Who hears of compiling: compile(n, loaded, seconds) before (loaded None) and after each call's compiling
    (loaded: whether JAX's persistent cache answered it); compiled(seconds) once a call is compiled (the loop's
    clock leaves that time out); fitted(fit, n, step) of each call fitted to the device's memory, before it runs."""

    compile: Callable[[int, bool | None, float], None] = lambda n, loaded, seconds: None
    compiled: Callable[[float], None] = lambda seconds: None
    fitted: Callable[[Fit, int, int], None] = lambda fitted, n, step: None


class Dispatcher:
    """Runs calls of `plan` on the micro-batches of `batches` (a DevicePrefetcher of stacked chunks).
    Compiling a call is timed under "compile" and told to `events`."""

    def __init__(self, plan: CallPlan, batches: DevicePrefetcher, timings: Timings, events: CallEvents = CallEvents()):
        self.plan, self.batches, self.timings, self.events = plan, batches, timings, events
        self.memory, self.steps = plan.memory, plan.steps_of(plan.memory)
        self.compiled: dict[int, Any] = {}
        self.last_synced = 0.0  # when the host had the metrics of the call before (its device time's start)

    def ready(self, n: int) -> bool:
        """Whether the call of n updates is compiled (dispatching it would not compile)."""
        return n in self.compiled

    def dispatch(self, state: TrainState, step: int, n: int) -> Call:
        """Dispatch the call of n updates after update `step`; the state is donated to it. Returns at once."""
        chunk = self.batches.take(self.plan.accum_steps * n)
        compiled = self._compiled(n, state, chunk, step)
        launched = time.perf_counter()
        new_state, metrics = compiled(state, chunk)
        return Call(new_state, metrics, step, launched)

    def wait(self, call: Call) -> Finished:
        """The finished call: the host waits here for its metrics (the applied update count with them)."""
        metrics = jax.device_get(call.metrics)
        synced, waited = time.perf_counter(), self.batches.total_wait_s
        seconds, self.last_synced = synced - max(call.launched, self.last_synced), synced
        return Finished(
            call.state, metrics, call.start, call.start + int(np.sum(metrics["updated"])), synced, waited, seconds
        )

    def data_state(self) -> dict[str, Any]:
        """The loader's checkpointable position: after the micro-batches dispatched, not those prefetched."""
        return self.batches.state()

    def _compiled(self, n: int, state: TrainState, chunk: Any, step: int) -> Any:
        """The call running n updates, compiled on first use (its own compile time is timed) and, with a
        memory plan, fitted to the device's memory (re-planned if it does not fit)."""
        if n not in self.compiled:
            self.events.compile(n, None, 0.0)
            t0 = time.perf_counter()
            with self.timings("compile"), loaded_from_cache() as cache:
                if self.memory is None:
                    compiled = self._compile(n, state, chunk, None)
                else:
                    fitted = fit(
                        lambda memory: self._compile(n, state, chunk, memory),
                        self.memory,
                        self.plan.batch_size,
                        self.plan.blocks,
                        f"the call of {n} update(s)",
                    )
                    if fitted.replanned:
                        self.steps, self.memory = self.plan.steps_of(fitted.memory), fitted.memory
                        self.compiled.clear()  # calls of other sizes compiled under the former plan
                    compiled = fitted.compiled
                    self.events.fitted(fitted, n, step)
                self.compiled[n] = compiled
            seconds = time.perf_counter() - t0
            self.events.compile(n, cache["loaded"], seconds)
            self.events.compiled(seconds)
        return self.compiled[n]

    def _compile(self, n: int, state: TrainState, chunk: Any, memory: MemoryConfig | None) -> Any:
        """The call of n updates under `memory` (None or the current plan: `steps`), jitted with the state
        donated and returned in its own shardings (jaxloop.update.distributed)."""
        steps = self.steps if memory is None or memory == self.memory else self.plan.steps_of(memory)
        return pin_shardings(steps, state, donate=True).lower(state, chunk).compile()
