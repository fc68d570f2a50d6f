"""Attention's second dot in another layout, side by side in one process: the built-in GPT's loss and gradient with
jaxloop's attention as it is (`bhqk,bkhd->bqhd`) and with v moved to [B, H, T, D] first (`bhqk,bhkd->bhqd`, the
result moved back), compared bit for bit and timed in rotated rounds (ms per call, median [min, max]).

    python benchmarks/attention_layout.py --shape gpt128 --rounds 4 --calls 3
    python benchmarks/attention_layout.py --shape gpt128 --variant barrier   # the layout kept, the softmax apart

`--variant barrier` keeps the layout and puts an optimization barrier between the softmax and the dot instead (XLA
then cannot fuse them): whether the fusion or the layout is what costs.

Why: on jaxlib 0.10.2's XLA:CPU the default layout's second dot, fused by YNNPACK with the transposes around it, is
the slowest op of the forward pass (docs/speed.md, "At real sizes on the CPU"). The variant is traced through
jaxloop's own attention (jaxloop.model.attention.dot_product_attention) with only that einsum replaced; the loss is
the one `--log.breakdown` times (jaxloop.observe.update_breakdown.params_loss). Nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


SECOND_DOT = "bhqk,bkhd->bqhd"
"""jaxloop's attention's second einsum (the weights times v), the one the variants replace."""


@contextlib.contextmanager
def second_dot(variant: str) -> Iterator[None]:
    """Inside the block, jaxloop's attention computes its second dot with v as [B, H, T, D] (`v_first`), or with
    the softmax's weights behind an optimization barrier (`barrier`); traced there. A RuntimeError at the end when
    no second dot was traced inside: the variant would be timed as jaxloop's own program, "identical"."""
    import jax
    import jax.numpy as jnp

    import jaxloop.model.attention as attention

    einsum = attention._einsum
    replaced = []

    def variant_einsum(spec, a, b, mm_dtype):
        if spec != SECOND_DOT:
            return einsum(spec, a, b, mm_dtype)
        replaced.append(spec)
        if variant == "barrier":
            return einsum(spec, jax.lax.optimization_barrier(a), b, mm_dtype)
        return jnp.swapaxes(einsum("bhqk,bhkd->bhqd", a, jnp.swapaxes(b, 1, 2), mm_dtype), 1, 2)

    attention._einsum = variant_einsum
    try:
        yield
    finally:
        attention._einsum = einsum
    if not replaced:
        raise RuntimeError(f"no {SECOND_DOT} einsum was traced inside second_dot({variant!r}): nothing was replaced")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt128", choices=("gpt64", "gpt128"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--variant", choices=("v_first", "barrier"), default="v_first")
    a = p.parse_args(argv)

    import jax
    import numpy as np

    from benchmarks.step import JaxUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits
    from jaxloop.observe.update_breakdown import params_loss
    from jaxloop.update.step import cross_entropy_loss

    cfg = make_cfg(a.shape)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 1)
    state = JaxUpdate(cfg, splits, batches).state
    batch = jax.device_put(batches[0])

    programs = {}
    for layout, scope in (("as is", contextlib.nullcontext()), ("variant", second_dot(a.variant))):
        loss = params_loss(state, cross_entropy_loss)  # a function of its own per layout: each is traced
        with scope:  # the layout is fixed when the program is traced
            programs[f"forward, {layout}"] = jax.jit(loss).lower(state.params, batch).compile()
            programs[f"gradient, {layout}"] = jax.jit(jax.grad(loss)).lower(state.params, batch).compile()
    out_of = {name: jax.device_get(fn(state.params, batch)) for name, fn in programs.items()}

    def moved(x, y) -> float:
        """Max over leaves of |x - y| / max |x|: 0.0 is bit for bit."""
        return max(
            float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) / (float(np.max(np.abs(np.asarray(u)))) or 1.0)
            for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y))
        )

    def timed(fn) -> float:
        t = time.perf_counter()
        for _ in range(a.calls):
            jax.block_until_ready(fn(state.params, batch))
        return (time.perf_counter() - t) / a.calls * 1e3

    for fn in programs.values():
        timed(fn)  # warm-up
    names = list(programs)
    ms: dict[str, list[float]] = {name: [] for name in names}
    for r in range(a.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms[name].append(timed(programs[name]))
        print(r, {k: round(v[-1], 1) for k, v in ms.items()}, file=sys.stderr)

    def spread(xs: list[float]) -> list[float]:
        return [round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)]

    out: dict = {"shape": a.shape, "variant": a.variant, "rounds": a.rounds, "calls": a.calls}
    for part in ("forward", "gradient"):
        base, other = ms[f"{part}, as is"], ms[f"{part}, variant"]
        out[part] = {
            "ms_as_is": spread(base),
            "ms_variant": spread(other),
            "ratio_variant": spread([y / x for x, y in zip(base, other)]),
            "moved": moved(out_of[f"{part}, as is"], out_of[f"{part}, variant"]),
        }
    out["load_average"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
