"""Generate text from a character-level run's checkpoint.

    python -m jaxloop.sample RUN_DIR --prompt "ROMEO:" [--length 200] [--temperature 0.8]
                                     [--checkpoint best|latest] [--seed 0]

Builds the model from RUN_DIR/config.json and the vocabulary from RUN_DIR/vocab.json, restores the
params of the best checkpoint (by the run's checkpoint.best_metric) or the latest one from
RUN_DIR/checkpoints, read-only, and samples `length` characters autoregressively: each step feeds the
last model.context characters and draws the next from softmax(logits / temperature) (temperature 0:
the most likely character). The whole generation is one jitted lax.scan. Prints the prompt followed by
the generated text on stdout. Bad input (no run, not a text run, no checkpoint, a prompt character
outside the vocabulary, a bad option): one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from jaxloop.core.config import Config

EXIT_BAD_INPUT = 2


class SampleError(ValueError):
    """Input the sampler cannot use; the message is the one line shown to the user."""


@dataclass
class Loaded:
    """Params restored from one checkpoint of a run."""

    step: int
    which: str  # "best" or "latest": what was actually loaded
    params: Any
    cfg: Config


def read_config(run_dir: str | Path) -> Config:
    """The Config saved with a run (jaxloop.core.run_dir.read_config), SampleError when there is none."""
    from jaxloop.core import run_dir as run_files

    try:
        return run_files.read_config(run_dir)
    except FileNotFoundError:
        raise SampleError(f"{run_dir} is not a jaxloop run directory (no config.json)") from None
    except ValueError as e:  # ConfigError and JSON errors alike
        raise SampleError(f"{run_files.RunLayout.of(run_dir).config} is not a valid run config ({e})") from None


def load_params(run_dir: str | Path, which: str = "best", cfg: Config | None = None) -> Loaded:
    """Read-only restore of the params of the best (by checkpoint.best_metric) or latest checkpoint
    (jaxloop.checkpoint.manager.read_checkpoint; SampleError when there is none)."""
    from jaxloop.checkpoint.manager import read_checkpoint

    if which not in ("best", "latest"):
        raise SampleError(f"--checkpoint={which!r} is not allowed: one of best, latest")
    cfg = cfg if cfg is not None else read_config(run_dir)
    try:
        step, chosen, state = read_checkpoint(run_dir, which, cfg)
    except FileNotFoundError as e:
        raise SampleError(str(e)) from None
    return Loaded(step=step, which=chosen, params=state["params"], cfg=cfg)


def make_generate(model: Any, context: int, length: int, vocab: int | None = None):
    """A jitted generate(params, buf, n, key, temperature) -> int32 [length] of sampled ids.

    buf: int32 [context], the prompt's last ids left-aligned (padding after them is never attended to:
    the model is causal); n: how many of buf are the prompt (1..context). vocab: only ids below it are
    drawn (a model.vocab_multiple model has logits for ids the vocabulary lacks).
    """
    import jax
    import jax.numpy as jnp

    def generate(params, buf, n, key, temperature):
        def one(carry, k):
            buf, n = carry
            logits = model.apply({"params": params}, buf[None], train=False)[0, n - 1, :vocab].astype(jnp.float32)
            drawn = jax.random.categorical(k, logits / jnp.maximum(temperature, 1e-6))
            nxt = jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)
            full = n >= context
            shifted = jnp.roll(buf, -1).at[context - 1].set(nxt)
            appended = buf.at[jnp.minimum(n, context - 1)].set(nxt)
            return (jnp.where(full, shifted, appended), jnp.minimum(n + 1, context)), nxt

        _, ids = jax.lax.scan(one, (buf, n), jax.random.split(key, length))
        return ids

    return jax.jit(generate)


def check_inputs(run_dir: str | Path, cfg: Config, prompt: str, length: int, temperature: float,
                 seed: int) -> tuple[tuple[str, ...], Any]:
    """(vocabulary, prompt ids) of a character-level run; SampleError for anything unusable."""
    from jaxloop.core.sources import encode, read_vocab

    if length < 1:
        raise SampleError(f"--length={length} is not allowed: an integer >= 1")
    if not temperature >= 0:
        raise SampleError(f"--temperature={temperature} is not allowed: a number >= 0 (0 = most likely)")
    if seed < 0:
        raise SampleError(f"--seed={seed} is not allowed: an integer >= 0")
    vocab = read_vocab(str(run_dir))
    if cfg.model.kind != "gpt" or cfg.data.source != "text" or vocab is None:
        raise SampleError(f"{run_dir} is not a character-level text run (data.source={cfg.data.source}, "
                          f"model.kind={cfg.model.kind}{', no vocab.json' if vocab is None else ''})")
    if not prompt:
        raise SampleError("--prompt is empty: give at least one character to continue")
    try:
        ids = encode(prompt, vocab)
    except ValueError as e:
        raise SampleError(f"--prompt holds {e}") from None
    return vocab, ids


def sample(run_dir: str | Path, prompt: str, length: int = 200, temperature: float = 1.0,
           which: str = "best", seed: int = 0, loaded: Loaded | None = None) -> str:
    """`length` characters generated after `prompt` by the run's best or latest checkpoint
    (or by `loaded`, params already restored with load_params)."""
    from jaxloop.model.builtin import make_model

    cfg = loaded.cfg if loaded is not None else read_config(run_dir)
    vocab, _ = check_inputs(run_dir, cfg, prompt, length, temperature, seed)
    with precision_scope(cfg):
        loaded = loaded if loaded is not None else load_params(run_dir, which, cfg)
        return generate(make_model(cfg.model, len(vocab), cfg.precision), loaded.params, vocab, prompt, length,
                        temperature, seed)


def precision_scope(cfg: Config) -> contextlib.AbstractContextManager:
    """jax's x64 mode for sampling an fp64 run (its float64 params), put back after; nothing for the others."""
    import jax

    return jax.enable_x64(True) if cfg.precision == "fp64" else contextlib.nullcontext()


def generate(model: Any, params: Any, vocab: Sequence[str], prompt: str, length: int = 200,
             temperature: float = 1.0, seed: int = 0) -> str:
    """`length` characters that the character-level GPT `model` (a jaxloop.model.builtin.GPT; its context is
    model.context) with `params` generates after `prompt`, under `vocab` (a run's vocab.json): what
    `sample` runs for a checkpoint, and what a hook runs for the state being trained."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxloop.core.sources import decode, encode

    ids, context = encode(prompt, vocab), model.context
    window = ids[-context:]
    buf = np.zeros(context, np.int32)
    buf[: len(window)] = window
    out = make_generate(model, context, length, len(vocab))(params, jnp.asarray(buf), jnp.asarray(len(window), jnp.int32),
                                                jax.random.PRNGKey(seed), jnp.asarray(temperature, jnp.float32))
    return decode(np.asarray(out), vocab)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxloop.sample",
                                     description="Print text generated from a character-level run's checkpoint.")
    parser.add_argument("run_dir", help="the run directory of a text (shakespeare-preset) run")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--length", type=int, default=200, help="characters to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="softmax temperature; 0 = always the most likely character (default 1.0)")
    parser.add_argument("--checkpoint", default="best",
                        help="best (by the run's checkpoint.best_metric) or latest (default best)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")

    def one_line_error(message: str) -> None:
        print(f"jaxloop.sample: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    parser.error = one_line_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        if args.checkpoint not in ("best", "latest"):
            raise SampleError(f"--checkpoint={args.checkpoint!r} is not allowed: one of best, latest")
        cfg = read_config(args.run_dir)
        check_inputs(args.run_dir, cfg, args.prompt, args.length, args.temperature, args.seed)
        loaded = load_params(args.run_dir, args.checkpoint, cfg)
        text = sample(args.run_dir, args.prompt, args.length, args.temperature, args.checkpoint, args.seed,
                      loaded=loaded)
    except SampleError as e:
        print(f"jaxloop.sample: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"jaxloop.sample: {args.length} characters from the {loaded.which} checkpoint "
          f"(update {loaded.step}) of {args.run_dir}", file=sys.stderr)
    sys.stdout.write(args.prompt + text + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
