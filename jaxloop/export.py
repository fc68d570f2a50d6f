"""`python -m jaxloop.export RUN_DIR`: a run's trained weights in files PyTorch users open.

    python -m jaxloop.export RUN_DIR [--checkpoint best|last|STEP] [--out DIR] [--format hf|params] [--ema]

A built-in GPT run (--format hf, its default): a Hugging Face GPT-2 directory, config.json and model.safetensors,
that transformers' GPT2LMHeadModel.from_pretrained(DIR) loads with jaxloop's logits (the mapping of
jaxloop.checkpoint.hf_gpt2; --ema: the EMA params instead). Any run, a Task of one's own too (--format params,
the default for those): DIR/params.safetensors holding the params under `params/<path>` and, when the run
keeps an EMA, `ema_params/<path>`, each path the pytree's keys '/'-joined (`params/Dense_0/kernel`), in the
checkpoint's dtypes. --out defaults to RUN_DIR/export. Prints the directory written. Bad input (no run, no
checkpoint, a Task run asked for --format hf, a bad option): one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.config.errors import EXIT_BAD_INPUT

PARAMS_FILE = "params.safetensors"


class ExportError(ValueError):
    """Input the exporter cannot use; the message is the one line shown to the user."""


def leaf_name(path: Any) -> str:
    """A pytree path's keys '/'-joined (dict keys, attribute names, sequence indices)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flat_arrays(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    """{prefix/path: numpy array} of every leaf of `tree` (C-contiguous, as safetensors stores them)."""
    import jax

    return {
        f"{prefix}/{leaf_name(p)}": np.ascontiguousarray(np.asarray(v))
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def is_builtin_gpt(run_dir: Path) -> bool:
    """Whether the run trained the built-in GPT (its metadata.json records the language-model facts only then)."""
    from jaxloop.rundir.layout import RunLayout

    meta = RunLayout.of(run_dir).read_json(RunLayout.of(run_dir).metadata)
    return isinstance(meta, dict) and "language_model" in meta


def export(
    run_dir: str | Path,
    checkpoint: str = "best",
    out: str | Path | None = None,
    fmt: str | None = None,
    ema: bool = False,
) -> Path:
    """Write the export of `run_dir` (module doc) and return its directory; ExportError for bad input."""
    from jaxloop.checkpoint import hf_gpt2
    from jaxloop.checkpoint.manager import read_checkpoint
    from jaxloop.rundir import rules as run_files

    run_dir = Path(run_dir)
    which = {"last": "latest"}.get(checkpoint, checkpoint)
    if which not in ("best", "latest") and not which.isdigit():
        raise ExportError(f"--checkpoint={checkpoint!r} is not allowed: best, last or an update number")
    if fmt not in (None, "hf", "params"):
        raise ExportError(f"--format={fmt!r} is not allowed: hf or params")
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} does not exist (a jaxloop run directory)")
    try:
        cfg = run_files.read_config(run_dir)
    except FileNotFoundError:
        raise ExportError(f"{run_dir} is not a jaxloop run directory (no config.json)") from None
    except ValueError as e:
        raise ExportError(f"{run_dir}/config.json is not a valid run config ({e})") from None
    builtin_gpt = is_builtin_gpt(run_dir)
    fmt = fmt or ("hf" if builtin_gpt else "params")
    if fmt == "hf" and not builtin_gpt:
        raise ExportError(
            f"--format hf exports the built-in GPT; {run_dir} trained another model "
            f"(--format params writes its params as {PARAMS_FILE})"
        )
    try:
        step, _, state = read_checkpoint(run_dir, which, cfg)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    emas = state.get("ema_params")
    if ema and not emas:
        raise ExportError(f"--ema: {run_dir} keeps no EMA of its params (optim.ema_decay was 0)")
    out = Path(out) if out is not None else run_dir / "export"
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    if fmt == "params":
        arrays = flat_arrays(state["params"], "params")
        if emas:
            arrays.update(flat_arrays(emas, "ema_params"))
        save_file(arrays, str(out / PARAMS_FILE), metadata={"format": "jaxloop params", "step": str(step)})
        return out
    params = jax_free(emas if ema else state["params"])
    vocab = int(np.shape(params["tok_embed"]["embedding"])[0])
    try:
        tensors = hf_gpt2.from_params(params)
    except hf_gpt2.HFError as e:
        raise ExportError(f"{run_dir}: {e}") from None
    save_file(tensors, str(out / hf_gpt2.SAFETENSORS_FILE), metadata={"format": "pt"})
    config = hf_gpt2.hf_config(cfg.model, vocab)
    (out / hf_gpt2.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def jax_free(tree: Any) -> Any:
    """Nested dicts of numpy float32/float64 arrays (a bf16 leaf widened to float32: safetensors.numpy and
    transformers' GPT-2 take the float types numpy has)."""
    if isinstance(tree, dict):
        return {k: jax_free(v) for k, v in tree.items()}
    a = np.asarray(tree)
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxloop.export",
        description="Write a run's weights as a Hugging Face GPT-2 directory or a safetensors file of its params.",
    )
    parser.add_argument("run_dir", help="a jaxloop run directory")
    parser.add_argument(
        "--checkpoint",
        default="best",
        help="best (by checkpoint.best_metric), last, or an update number (default best)",
    )
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/export)")
    parser.add_argument("--format", default=None, help="hf (a built-in GPT run's default) or params (any run's)")
    parser.add_argument("--ema", action="store_true", help="--format hf: the EMA params (optim.ema_decay > 0)")

    def one_line_error(message: str) -> None:
        print(f"jaxloop.export: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    parser.error = one_line_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.checkpoint, args.out, args.format, args.ema)
    except ExportError as e:
        print(f"jaxloop.export: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
