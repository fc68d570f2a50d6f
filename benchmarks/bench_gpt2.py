"""GPT-2 small rows: the update of `--preset gpt2-small`'s model, jaxloop against torch_ref eager and
torch_ref under torch.compile, on the same initial weights (jaxloop's, loaded into torch_ref), the same
batches (the first micro-batches of jaxloop's record order) and the same threads; tokens per second.

gpt2.cpu   the real GPT-2 small (12 x 768, 12 heads, GPT-2's vocabulary 50257 padded to 50304, tied) at
           context 128 and batch 2 (256 tokens per update) in fp32, so that a 2-core machine runs a few
           updates of each in a minute or two. The tokens are the shipped text's characters (ids < 128 of
           the 50304): the work per update is GPT-2 small's, whatever the ids.
gpt2.gpu   on a GPU: context 1024, batch 16, bf16 (jaxloop's autocast-like policy, torch_ref's autocast),
           model.attention=auto; tokens/s and MFU against the device's table peak (jaxloop.model.flops).
           Without a GPU the row says unmeasured.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks.common import Options, Row, failed, gpu_present, median, sized_interleaved, text_path

GPT2_VOCAB = 50257


def gpt2_cfg(context: int, batch: int, precision: str):
    """--preset gpt2-small at this context, batch and precision, over the shipped text read as characters (the
    update's time does not depend on which tokens it reads), with GPT-2's vocabulary."""
    from jaxloop.config.run import preset

    base = preset("gpt2-small")
    return dataclasses.replace(
        base,
        batch_size=batch,
        precision=precision,
        model=dataclasses.replace(base.model, context=context, vocab_size=GPT2_VOCAB),
        data=dataclasses.replace(base.data, source="text", path=str(text_path())),
    )


def _contenders(cfg, device: str, compile_torch: bool) -> tuple[dict[str, Any], list[str], Any]:
    from benchmarks.step import JaxUpdate, TorchUpdate, host_batches
    from jaxloop.data.sources import load_splits

    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 2)
    jx = JaxUpdate(cfg, splits, batches)
    contenders: dict[str, Any] = {
        "jaxloop": jx,
        "torch eager": TorchUpdate(cfg, splits, batches, jx.init_params, device=device),
    }
    notes = [f"jaxloop compile {jx.compile_s:.1f} s"]
    if compile_torch:
        try:
            tc = TorchUpdate(cfg, splits, batches, jx.init_params, compiled=True, device=device)
            t0 = time.perf_counter()
            tc(1)  # compiles the model's forward and backward
            notes.append(f"torch.compile first update {time.perf_counter() - t0:.1f} s")
            contenders["torch.compile"] = tc
        except Exception as e:  # noqa: BLE001 - reported in the row, not fatal
            notes.append(f"torch.compile failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
    return contenders, notes, splits


def _tokens_row(row: Row, cfg, med: dict[str, float], notes: list[str]) -> Row:
    tokens = cfg.batch_size * cfg.model.context
    rates = {name: tokens / s for name, s in med.items()}
    row.jax, row.ref = rates["jaxloop"], rates["torch eager"]
    row.ratio = rates["jaxloop"] / rates["torch eager"]
    if "torch.compile" in rates:
        row.extra["ratio_vs_torch_compile"] = rates["jaxloop"] / rates["torch.compile"]
        notes.append(
            f"torch.compile {rates['torch.compile']:,.0f} tokens/s -> jaxloop/torch.compile "
            f"{row.extra['ratio_vs_torch_compile']:.2f}"
        )
    row.extra.update(tokens_per_s=rates, s_per_update=med)
    return row


def cpu_row(opts: Options) -> Row:
    """GPT-2 small, context 128, batch 2, fp32, on the CPU: tokens/s of jaxloop / torch_ref eager (/ torch.compile)."""
    row = Row(
        "gpt2.cpu",
        "GPT-2 small update (124M, ctx 128, batch 2, fp32) on the CPU: tokens/s, jaxloop / torch_ref eager",
        unit="tokens/s",
        goal="info",
    )
    try:
        import torch

        torch.set_num_threads(opts.threads)
        cfg = gpt2_cfg(context=32 if opts.smoke else 128, batch=2, precision="fp32")
        contenders, notes, _ = _contenders(cfg, "cpu", compile_torch=not opts.quick)
        times = sized_interleaved(contenders, rounds=1 if opts.smoke else 3, block_s=0.0, warm=(1, 1))
        med = {name: median(v) for name, v in times.items()}
        _tokens_row(row, cfg, med, notes)
        from jaxloop.model.flops import flops_per_token

        fpt = flops_per_token(cfg.model, GPT2_VOCAB)
        row.extra["flops_per_token"] = fpt
        notes.append(
            f"jaxloop {row.jax * fpt / 1e9:.1f} GFLOP/s by 6N + 12LTd ({fpt / 1e6:.0f} MFLOP/token); one update "
            f"per block, {len(times['jaxloop'])} rounds interleaved"
        )
        row.notes = "; ".join(notes)
        return row
    except Exception as e:  # noqa: BLE001
        return failed(row, e)


def gpu_row(opts: Options) -> Row:
    """On a GPU: GPT-2 small bf16 at context 1024, batch 16: tokens/s and MFU, jaxloop / torch_ref eager / torch.compile."""
    row = Row(
        "gpt2.gpu",
        "GPT-2 small update (124M, ctx 1024, batch 16, bf16) on a GPU: tokens/s, jaxloop / torch_ref eager",
        unit="tokens/s",
        goal=">= 0.45 MFU",
    )
    if not gpu_present():
        row.status, row.notes = "unmeasured", "unmeasured: no GPU lent to this task"
        return row
    try:
        import jax

        from jaxloop.model.flops import flops_per_token, table_peak

        cfg = gpt2_cfg(context=1024, batch=16, precision="bf16")
        contenders, notes, _ = _contenders(cfg, "cuda", compile_torch=True)
        times = sized_interleaved(contenders, rounds=5, block_s=1.0, warm=(3, 5))
        med = {name: median(v) for name, v in times.items()}
        _tokens_row(row, cfg, med, notes)
        kind = jax.devices()[0].device_kind
        peak = table_peak(kind, "bf16")
        if peak:
            fpt = flops_per_token(cfg.model, GPT2_VOCAB)
            mfu = {name: rate * fpt / peak for name, rate in row.extra["tokens_per_s"].items()}
            row.extra["mfu"] = mfu
            row.met = mfu["jaxloop"] >= 0.45
            notes.append(
                "MFU (6N + 12LTd, "
                + f"{kind} bf16 {peak / 1e12:g} TFLOP/s): "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in mfu.items())
            )
        else:
            notes.append(f"no table peak for {kind}: MFU not computed")
        row.notes = "; ".join(notes)
        return row
    except Exception as e:  # noqa: BLE001
        return failed(row, e)
