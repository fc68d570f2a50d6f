"""Rows measured in this process: matmul peak, the update (jaxloop vs torch_ref eager / torch.compile), evaluation.

Every contender gets the same batches (the first micro-batches of the run's record order, real data),
the same initial weights (jaxloop's, loaded into torch_ref), the same precision (fp32) and the same
threads (XLA:CPU uses every core; torch.set_num_threads(cores)). An update is K micro-batches:
K calls of jaxloop's compiled train_step (optax.MultiSteps accumulates), one torch_ref.step.train_update
over K micro-batches. Times are seconds per update: after warm-up, a block of updates per contender
per round, rounds interleaved (A B C A B C ...), median over rounds.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from benchmarks.common import Options, Row, failed, interleaved, median, sized_interleaved, text_path

SHAPES = {
    "gpt128": {"kind": "gpt", "context": 128, "batch": 32, "label": "GPT ctx128 b32 (4x128)"},
    "gpt64": {"kind": "gpt", "context": 64, "batch": 12, "label": "GPT ctx64 b12 (4x128)"},
    "mlp": {"kind": "mlp", "batch": 64, "label": "digits MLP b64 (64-128-128-10)"},
}


def make_cfg(shape: str, accum: int = 1, **overrides: Any):
    """The config of a benchmark shape: the preset, at this context and batch, K micro-batches per update."""
    from jaxloop.config.run import preset

    s = SHAPES[shape]
    if s["kind"] == "mlp":
        cfg = dataclasses.replace(preset("digits"), batch_size=s["batch"])
    else:
        base = preset("shakespeare")
        cfg = dataclasses.replace(
            base,
            batch_size=s["batch"],
            model=dataclasses.replace(base.model, context=s["context"]),
            data=dataclasses.replace(base.data, path=str(text_path())),
        )
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, accum_steps=accum), **overrides)


def set_threads(opts: Options) -> None:
    import torch

    torch.set_num_threads(opts.threads)


def host_batches(cfg, splits, count: int) -> list[dict[str, np.ndarray]]:
    """The run's first `count` micro-batches, in jaxloop's record order."""
    from jaxloop.data.sources import record_order

    return [splits.train.get(row) for row in record_order(cfg, splits.num_train, 0, count)]


def splits_for(opts: Options, shape: str):
    key = ("splits", shape)
    if key not in opts.cache:
        from jaxloop.data.sources import load_splits

        opts.cache[key] = load_splits(make_cfg(shape))
    return opts.cache[key]


# ----------------------------------------------------------------------------- contenders


class JaxUpdate:
    """K calls of the compiled (lowered + compiled ahead of time, as the loop does) train_step; with
    per_call > 1, the loop's call instead: one lax.scan (scan_steps) over K x per_call stacked micro-batches."""

    def __init__(self, cfg, splits, batches, per_call: int = 1):
        import jax
        import numpy as np

        from jaxloop.loop.task import create_train_state
        from jaxloop.model.builtin import make_model
        from jaxloop.update.step import cross_entropy_loss, make_train_step, scan_steps, train_step

        self.K, self.per_call = cfg.optim.accum_steps, per_call
        model = make_model(cfg.model, splits.num_classes, cfg.precision)
        self.state = create_train_state(cfg, model, splits.example_x)
        self.init_params = jax.device_get(self.state.params)
        step = jax.jit(train_step, donate_argnums=0)  # as the loop builds it
        if per_call > 1:
            n = self.K * per_call
            batches = [
                {k: np.stack([b[k] for b in batches[i : i + n]]) for k in batches[0]}
                for i in range(0, len(batches) - n + 1, n)
            ]
            step = jax.jit(scan_steps(make_train_step(cross_entropy_loss)), donate_argnums=0)
        self.batches = [jax.device_put(b) for b in batches]
        c0, t0 = time.process_time(), time.perf_counter()
        self.step = step.lower(self.state, self.batches[0]).compile()
        self.compile_s, self.compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        self.flops = hlo_flops(self.step)
        self.i = 0

    def __call__(self, updates: int) -> float:
        """Seconds per update over a block of `updates` (rounded up to whole calls)."""
        import jax

        calls = -(-updates // self.per_call) if self.per_call > 1 else updates * self.K
        t0 = time.perf_counter()
        metrics = None
        for _ in range(calls):
            self.state, metrics = self.step(self.state, self.batches[self.i % len(self.batches)])
            self.i += 1
        jax.block_until_ready((self.state, metrics))  # host waits for the block's last call
        return (time.perf_counter() - t0) / (calls * self.per_call if self.per_call > 1 else updates)


class TorchUpdate:
    """torch_ref.step.train_update over K micro-batches (eager, or the model under torch.compile)."""

    def __init__(self, cfg, splits, batches, init_params, compiled: bool = False, device: str = "cpu"):
        import torch

        from torch_ref.state import create_torch_state

        self.state = create_torch_state(cfg, splits, init_params=init_params, device=device)
        if compiled:
            self.state.model = torch.compile(self.state.model)
        self.K = cfg.optim.accum_steps
        self.device = torch.device(device)
        # on the device already, as jaxloop's batches are (device_put): both time the update, not the copy
        self.batches = [
            (
                torch.from_numpy(np.ascontiguousarray(b["x"])).to(self.device),
                torch.from_numpy(np.ascontiguousarray(b["y"])).to(self.device),
            )
            for b in batches
        ]
        self.i = 0

    def __call__(self, updates: int) -> float:
        import torch

        from torch_ref.step import train_update

        t0 = time.perf_counter()
        for _ in range(updates):
            micro = [self.batches[(self.i + k) % len(self.batches)] for k in range(self.K)]
            self.i += self.K
            train_update(self.state, micro)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # host waits for the GPU's queue (train_update's .item() calls already did)
        return (time.perf_counter() - t0) / updates


def hlo_flops(compiled: Any) -> float | None:
    """FLOPs of one call from XLA's cost analysis of the compiled executable (None if unavailable)."""
    try:
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):
            cost = cost[0]
        flops = float(cost.get("flops", 0.0))
        return flops if flops > 0 else None
    except Exception:  # noqa: BLE001 - backends without a cost model
        return None


def analytic_flops(cfg, vocab: int) -> float:
    """Training FLOPs of one micro-batch of the GPT: 6 N tokens (N: block matrices and the tied head)
    plus attention's two T x T matmuls (computed in full, mask applied after), forward and backward."""
    m = cfg.model
    d, T, B, L = m.d_model, m.context, cfg.batch_size, m.n_layers
    n_matmul = L * (3 * d * d + d * d + 2 * m.mlp_ratio * d * d) + vocab * d
    return 6.0 * n_matmul * B * T + 3.0 * L * B * (2 * 2 * T * T * d)


# ----------------------------------------------------------------------------- rows


def matmul_peak(opts: Options) -> Row:
    """This CPU's measured fp32 matmul rate: the best of a jitted jnp.dot and torch.mm, n x n, in a loop."""
    import jax
    import jax.numpy as jnp
    import torch

    set_threads(opts)
    n = 1024 if opts.quick else 2048
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    ja, jb = jax.device_put(a), jax.device_put(b)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(ja, jb))
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    torch.mm(ta, tb)
    reps = 3 if opts.quick else 10

    def jax_block() -> float:
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = dot(ja, jb)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps

    def torch_block() -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(ta, tb)
        return (time.perf_counter() - t0) / reps

    times = interleaved({"jax": jax_block, "torch": torch_block}, rounds=3 if opts.quick else 5)
    flop = 2.0 * n**3
    jrate, trate = flop / min(times["jax"]), flop / min(times["torch"])
    peak = max(jrate, trate)
    opts.cache["peak_flops"] = peak
    return Row(
        "peak",
        f"fp32 matmul {n}x{n}, best of jnp.dot / torch.mm",
        jax=jrate / 1e9,
        ref=trate / 1e9,
        unit="GFLOP/s",
        ratio=jrate / trate,
        goal="info",
        notes=f"peak used for % of peak: {peak / 1e9:.1f} GFLOP/s (best over rounds)",
    )


def step_row(opts: Options, shape: str, accum: int) -> Row:
    """jaxloop's compiled update vs torch_ref eager vs torch_ref + torch.compile."""
    s = SHAPES[shape]
    row = Row(f"step.{shape}.k{accum}", f"update, {s['label']}, K={accum}, fp32", unit="ms/update")
    goal = 0.5 if s["kind"] == "mlp" else 0.7
    try:
        set_threads(opts)
        cfg = make_cfg(shape, accum)
        splits = splits_for(opts, shape)
        batches = host_batches(cfg, splits, 2 * accum if accum > 1 else 4)
        jx = JaxUpdate(cfg, splits, batches)
        contenders: dict[str, Any] = {"jaxloop": jx, "torch eager": TorchUpdate(cfg, splits, batches, jx.init_params)}
        compile_note = ""
        if opts.quick:
            compile_note = "torch.compile: skipped under --quick"
        else:
            try:
                tc = TorchUpdate(cfg, splits, batches, jx.init_params, compiled=True)
                t0 = time.perf_counter()
                tc(1)  # compiles the model's forward and backward
                compile_note = f"torch.compile ok (first update {time.perf_counter() - t0:.1f} s)"
                contenders["torch.compile"] = tc
            except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
                compile_note = f"torch.compile failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        times = sized_interleaved(
            contenders,
            rounds=1 if opts.smoke else 3 if opts.quick else 7,
            block_s=0.01 if opts.smoke else 0.3 if opts.quick else 1.0,
            warm=(1, 1 if opts.smoke else 2),
        )
        med = {name: median(v) for name, v in times.items()}
        row.jax, row.ref = 1e3 * med["jaxloop"], 1e3 * med["torch eager"]
        row.ratio = med["jaxloop"] / med["torch eager"]
        row.check("<=", goal)
        notes = [compile_note]
        row.extra = {
            "ms": {k: 1e3 * v for k, v in med.items()},
            "rounds_ms": {k: [1e3 * x for x in v] for k, v in times.items()},
            "jax_compile_s": jx.compile_s,
            "jax_compile_cpu_s": jx.compile_cpu_s,
        }
        if "torch.compile" in med:
            r = med["jaxloop"] / med["torch.compile"]
            row.extra["ratio_vs_torch_compile"] = r
            ok = r <= 1.0
            row.met = bool(row.met) and ok
            notes.append(
                f"torch.compile {1e3 * med['torch.compile']:.2f} ms -> jax/compile {r:.2f} (goal <= 1: "
                f"{'met' if ok else 'NOT met'})"
            )
        if cfg.model.kind == "gpt":
            flops = (jx.flops or analytic_flops(cfg, splits.num_classes)) * accum
            row.extra.update(
                hlo_flops_per_update=(jx.flops or 0) * accum,
                analytic_flops_per_update=analytic_flops(cfg, splits.num_classes) * accum,
            )
            rate = flops / med["jaxloop"]
            if "peak_flops" not in opts.cache:  # --only without the peak row: measure it now
                matmul_peak(opts)
            peak = opts.cache.get("peak_flops")
            row.extra["gflops"] = rate / 1e9
            pct = f", {100 * rate / peak:.0f}% of measured peak" if peak else ""
            notes.append(
                f"jaxloop {rate / 1e9:.1f} GFLOP/s ({'HLO' if jx.flops else 'analytic'} count; analytic "
                f"{analytic_flops(cfg, splits.num_classes) * accum / 1e9:.2f} GFLOP/update){pct}"
            )
            opts.cache[("train_tokens_per_s", shape)] = cfg.batch_size * cfg.model.context * accum / med["jaxloop"]
        row.notes = "; ".join(n for n in notes if n)
        return row
    except Exception as e:  # noqa: BLE001
        return failed(row, e)


def eval_row(opts: Options, shape: str = "gpt128") -> Row:
    """Tokens/s of a full validation pass (eval_step over val_batches, eval_batch_size) vs training tokens/s."""
    row = Row(f"eval.{shape}", f"validation pass vs training, {SHAPES[shape]['label']}", unit="tokens/s")
    try:
        import jax

        from jaxloop.data.pipeline import eval_batch_size, val_batches
        from jaxloop.loop.task import create_train_state
        from jaxloop.model.builtin import make_model
        from jaxloop.update.step import eval_step

        cfg = make_cfg(shape)
        splits = splits_for(opts, shape)
        train_rate = opts.cache.get(("train_tokens_per_s", shape))
        if train_rate is None:
            batches = host_batches(cfg, splits, 4)
            jx = JaxUpdate(cfg, splits, batches)
            jx(1)
            train_rate = cfg.batch_size * cfg.model.context / median([jx(3) for _ in range(3)])
            state = jx.state
        else:
            state = create_train_state(cfg, make_model(cfg.model, splits.num_classes, cfg.precision), splits.example_x)
        val = list(val_batches(splits, eval_batch_size(cfg)))
        if opts.quick:
            val = val[:2]
        tokens = sum(float(b["weight"].sum()) for b in val) * cfg.model.context
        step = eval_step.lower(state, val[0]).compile()

        def full_pass() -> float:
            t0 = time.perf_counter()
            out = [step(state, b) for b in val]  # as the loop's evaluate(): dispatch all, then fetch
            jax.device_get(out)
            return time.perf_counter() - t0

        full_pass()
        eval_rate = tokens / median([full_pass() for _ in range(2 if opts.quick else 5)])
        row.jax, row.ref, row.ratio = eval_rate, train_rate, eval_rate / train_rate
        row.check(">=", 3.0)
        row.notes = (
            f"{len(val)} batches of {cfg.data.eval_batch_size or cfg.batch_size}"
            f"{' (first 2 only, --quick)' if opts.quick else ' (whole split)'}; ref column = jaxloop "
            "training tokens/s (compiled update alone)"
        )
        return row
    except Exception as e:  # noqa: BLE001
        return failed(row, e)
