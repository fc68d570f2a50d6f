"""Generate text from a language-model run's checkpoint: a character-level text run or a token-shard run.

    python -m jaxloop.sample RUN_DIR --prompt "ROMEO:" [--length 200] [--temperature 0.8] [--top_k K]
                                     [--checkpoint best|latest] [--seed 0] [--tokenizer PATH] [--no_kv_cache]

Builds the model from RUN_DIR/config.json and the text codec from the run: the vocabulary of a text run
(RUN_DIR/vocab.json), or for a token run the tokenizer that jaxloop.prepare recorded beside the shards
(data.path's meta.json: bytes, or its tokenizer.json), else the tokenizer files of the run's init_from directory,
else --tokenizer (a tokenizer.json or a Hugging Face model directory). Restores the params of the best checkpoint
(by the run's checkpoint.best_metric) or the latest one, read-only, and samples `length` tokens
autoregressively, nanoGPT's way: softmax(logits / temperature) over the top_k most likely (temperature 0: the
most likely). With the KV cache (the default) the prompt's window is run once (prefill) and then one token per
step against a cache of model.context positions; once the window is full, each step runs the last
model.context tokens whole, as without the cache. The whole generation is one jitted lax.scan. Prints the
prompt followed by the generated text on stdout. Bad input (no run, not a language-model run, no checkpoint,
no tokenizer, a prompt the codec cannot encode, a bad option): one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.config.run import Config

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
    """The Config saved with a run (jaxloop.rundir.rules.read_config), SampleError when there is none."""
    from jaxloop.rundir import rules as run_files

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


class Codec:
    """Text <-> token ids of a run: a text run's characters, bytes, or a Hugging Face tokenizer."""

    def __init__(self, size: int, describe: str, chars: Sequence[str] | None = None, tokenizer: Any = None):
        self.size, self.describe, self.chars, self.tokenizer = size, describe, chars, tokenizer

    @classmethod
    def of(cls, vocab: Sequence[str] | Codec) -> Codec:
        """`vocab` as a Codec: a text run's vocabulary (vocab.json's characters) or a Codec already."""
        return vocab if isinstance(vocab, Codec) else cls(len(vocab), "the run's vocab.json", chars=tuple(vocab))

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of `text` (ValueError naming what cannot be encoded)."""
        from jaxloop.data.sources import encode

        if self.chars is not None:
            return np.asarray(encode(text, self.chars), np.int32)
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        from jaxloop.data.sources import decode

        if self.chars is not None:
            return decode(ids, self.chars)
        if self.tokenizer is None:
            return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def run_codec(run_dir: str | Path, cfg: Config, tokenizer: str | None = None) -> Codec:
    """The codec of a run (see the module doc for where it comes from); SampleError when it has none."""
    from jaxloop.data.sources import read_vocab
    from jaxloop.prepare import read_tokenizer

    def from_path(path: str, flag: str) -> Codec:
        try:
            tok = read_tokenizer(path)
        except ValueError as e:
            raise SampleError(f"{flag}={path} is not allowed: {e}") from None
        return Codec(tok.get_vocab_size(), path, tokenizer=tok)

    if cfg.model.kind != "gpt" or cfg.data.source not in ("text", "tokens"):
        raise SampleError(
            f"{run_dir} is not a language-model run (model.kind={cfg.model.kind}, data.source="
            f"{cfg.data.source}): sampling needs a GPT trained on text or token shards"
        )
    if tokenizer:
        return from_path(tokenizer, "--tokenizer")
    if cfg.data.source == "text":
        vocab = read_vocab(str(run_dir))
        if vocab is None:
            raise SampleError(f"{run_dir} is a text run without its vocab.json")
        return Codec.of(vocab)
    meta = _shards_meta(cfg.data.path)
    if meta is not None and meta.get("tokenizer") == "bytes":
        return Codec(256, f"bytes ({cfg.data.path} meta.json)")
    if meta is not None and meta.get("tokenizer_file"):
        path = os.path.join(_shards_dir(cfg.data.path), meta["tokenizer_file"])
        if os.path.isfile(path):
            return from_path(path, "data.path's meta.json tokenizer_file")
    if cfg.init_from and os.path.isdir(cfg.init_from):
        try:
            tok = read_tokenizer(cfg.init_from)  # a Hugging Face model directory's tokenizer files
        except ValueError:
            tok = None  # a jaxloop run: no tokenizer there
        if tok is not None:
            return Codec(tok.get_vocab_size(), cfg.init_from, tokenizer=tok)
    raise SampleError(
        f"{run_dir} is a token run whose tokenizer is not recorded (data.path={cfg.data.path} has no "
        "meta.json naming one there): give --tokenizer tokenizer.json or a Hugging Face model directory"
    )


def _shards_dir(path: str) -> str:
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _shards_meta(path: str) -> dict[str, Any] | None:
    """data.path's meta.json (jaxloop.prepare's record), or None when it has none or cannot be read."""
    from jaxloop.data.shards import META_FILE

    try:
        with open(os.path.join(_shards_dir(path), META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


class Generate:
    """A compiled generate(params, buf, n, key, temperature) -> int32 [length] of sampled ids, for one
    configuration: `fn(...)` runs it, `fn.lower(...)` lowers it ahead of time (jax.jit's AOT path)."""

    def __init__(self, statics: dict[str, Any]):
        import jax

        # jax keys its compiled executables by the function (module-level _generated_ids, never a fresh closure)
        # and the static arguments (the configuration: a Flax module hashes by its fields): a second Generate of the
        # same configuration, or a hook sampling at every evaluation, runs the executable the first compiled. A
        # model that does not hash (a field holding a list) is closed over instead, and compiled by each Generate.
        try:
            hash(tuple(statics.values()))
        except TypeError:
            self.statics, self.jitted = {}, jax.jit(functools.partial(_generated_ids, **statics))
        else:
            self.statics, self.jitted = statics, jax.jit(_generated_ids, static_argnames=tuple(statics))

    def __call__(self, *args: Any) -> Any:
        return self.jitted(*args, **self.statics)

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*args, **self.statics)


def make_generate(
    model: Any, context: int, length: int, vocab: int | None = None, kv_cache: bool = True, top_k: int | None = None
) -> Generate:
    """A jitted generate(params, buf, n, key, temperature) -> int32 [length] of sampled ids.

    buf: int32 [context], the prompt's last ids left-aligned (padding after them is never attended to:
    the model is causal); n: how many of buf are the prompt (1..context). vocab: only ids below it are
    drawn (a model.vocab_multiple model has logits for ids the vocabulary lacks); top_k: only the k most likely.
    kv_cache: prefill the window once, then one token per step against model's KV cache (cache_index: the
    built-in GPT's decode path; other models run the whole window) until the window is full; without it every
    step runs the whole window. Compiled once per process for each configuration (model, context, length, vocab,
    kv_cache, top_k) and parameter shapes: making it again, as every `generate` call does, reuses that.
    """
    from jaxloop.model.builtin import GPT

    kv_cache = kv_cache and isinstance(model, GPT)  # the decode path (cache_index) is the built-in GPT's
    model = model.clone(remat=False) if getattr(model, "remat", False) else model
    return Generate(dict(model=model, context=context, length=length, vocab=vocab, kv_cache=kv_cache, top_k=top_k))


def _generated_ids(
    params: Any,
    buf: Any,
    n: Any,
    key: Any,
    temperature: Any,
    *,
    model: Any,
    context: int,
    length: int,
    vocab: int | None,
    kv_cache: bool,
    top_k: int | None,
) -> Any:
    """make_generate's computation (its doc), traced under jax.jit with the configuration static."""
    import jax
    import jax.numpy as jnp

    def full(params, buf, n):
        return model.apply({"params": params}, buf[None], train=False)[0, n - 1, :vocab].astype(jnp.float32)

    def draw(logits, k, temperature):
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        drawn = jax.random.categorical(k, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)

    def append(buf, n, nxt):
        shifted = jnp.roll(buf, -1).at[context - 1].set(nxt)
        appended = buf.at[jnp.minimum(n, context - 1)].set(nxt)
        return jnp.where(n >= context, shifted, appended), jnp.minimum(n + 1, context)

    keys = jax.random.split(key, length)
    if not kv_cache:

        def one(carry, k):
            buf, n = carry
            nxt = draw(full(params, buf, n), k, temperature)
            return append(buf, n, nxt), nxt

        return jax.lax.scan(one, (buf, n), keys)[1]

    logits, variables = model.apply(
        {"params": params}, buf[None], train=False, cache_index=jnp.int32(0), mutable=["cache"]
    )

    def step(carry, k):
        buf, n, cache, logits = carry
        nxt = draw(logits, k, temperature)
        at = n  # the new token's position, while the window has room

        def cached(cache):
            out, new = model.apply(
                {"params": params, "cache": cache}, nxt[None, None], train=False, cache_index=at, mutable=["cache"]
            )
            return out[0, 0, :vocab].astype(jnp.float32), new["cache"]

        buf, n = append(buf, n, nxt)
        logits, cache = jax.lax.cond(at < context, cached, lambda cache: (full(params, buf, n), cache), cache)
        return (buf, n, cache, logits), nxt

    first = logits[0, n - 1, :vocab].astype(jnp.float32)
    return jax.lax.scan(step, (buf, n, variables["cache"], first), keys)[1]


def check_options(length: int, temperature: float, seed: int, top_k: int | None = None) -> None:
    """SampleError naming the flag for an option out of range."""
    if length < 1:
        raise SampleError(f"--length={length} is not allowed: an integer >= 1")
    if not temperature >= 0:
        raise SampleError(f"--temperature={temperature} is not allowed: a number >= 0 (0 = most likely)")
    if seed < 0:
        raise SampleError(f"--seed={seed} is not allowed: an integer >= 0")
    if top_k is not None and top_k < 1:
        raise SampleError(f"--top_k={top_k} is not allowed: an integer >= 1 (or leave it out: all tokens)")


def encode_prompt(codec: Codec, prompt: str) -> np.ndarray:
    """The prompt's ids under `codec`; SampleError when it is empty or holds what the codec cannot encode."""
    if not prompt:
        raise SampleError("--prompt is empty: give at least one character to continue")
    try:
        ids = codec.encode(prompt)
    except ValueError as e:
        raise SampleError(f"--prompt holds {e}") from None
    if ids.size == 0:
        raise SampleError(f"--prompt={prompt!r} encodes to no tokens under {codec.describe}")
    return ids


def sample(
    run_dir: str | Path,
    prompt: str,
    length: int = 200,
    temperature: float = 1.0,
    which: str = "best",
    seed: int = 0,
    loaded: Loaded | None = None,
    top_k: int | None = None,
    tokenizer: str | None = None,
    kv_cache: bool = True,
) -> str:
    """`length` tokens (characters of a text run) generated after `prompt` by the run's best or latest checkpoint
    (or by `loaded`, params already restored with load_params), decoded to text."""
    cfg = loaded.cfg if loaded is not None else read_config(run_dir)
    check_options(length, temperature, seed, top_k)
    codec = run_codec(run_dir, cfg, tokenizer)
    encode_prompt(codec, prompt)
    with precision_scope(cfg):
        loaded = loaded if loaded is not None else load_params(run_dir, which, cfg)
        return generate(
            run_model(loaded), loaded.params, codec, prompt, length, temperature, seed, top_k=top_k, kv_cache=kv_cache
        )


def run_model(loaded: Loaded) -> Any:
    """The run's GPT, its vocabulary as long as the checkpoint's token embedding (padding included)."""
    from jaxloop.model.builtin import make_model

    rows = int(np.shape(loaded.params["tok_embed"]["embedding"])[0])
    return make_model(loaded.cfg.model, rows, loaded.cfg.precision)


def precision_scope(cfg: Config) -> contextlib.AbstractContextManager:
    """jax's x64 mode for sampling an fp64 run (its float64 params), put back after; nothing for the others."""
    import jax

    return jax.enable_x64(True) if cfg.precision == "fp64" else contextlib.nullcontext()


def generate(
    model: Any,
    params: Any,
    vocab: Sequence[str] | Codec,
    prompt: str,
    length: int = 200,
    temperature: float = 1.0,
    seed: int = 0,
    top_k: int | None = None,
    kv_cache: bool = True,
    timing: dict[str, float] | None = None,
    announce: Callable[[str], None] | None = None,
) -> str:
    """`length` tokens that the GPT `model` (a jaxloop.model.builtin.GPT; its context is model.context) with `params`
    generates after `prompt`, decoded by `vocab` (a text run's vocab.json characters, or a Codec: run_codec):
    what `sample` runs for a checkpoint, and what a hook runs for the state being trained. `timing`, when given,
    receives compile_s and generate_s (the compiled call alone, to the last token); `announce`, when given, receives
    a line before the compile and one with its time after (the CLI's stderr: a compile is seconds of silence)."""
    import jax
    import jax.numpy as jnp

    codec, context = Codec.of(vocab), model.context
    ids = encode_prompt(codec, prompt)
    window = ids[-context:]
    buf = np.zeros(context, np.int32)
    buf[: len(window)] = window
    args = (
        params,
        jnp.asarray(buf),
        jnp.asarray(len(window), jnp.int32),
        jax.random.PRNGKey(seed),
        jnp.asarray(temperature, jnp.float32),
    )
    fn = make_generate(model, context, length, min(codec.size, model.vocab_size), kv_cache, top_k)
    if announce is not None:
        announce(f"compiling the sampling call ({length} tokens, {'KV cache' if kv_cache else 'no KV cache'})...")
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    t1 = time.perf_counter()
    if announce is not None:
        announce(f"compiled in {t1 - t0:.1f}s")
    out = np.asarray(compiled(*args))
    if timing is not None:
        timing.update(compile_s=t1 - t0, generate_s=time.perf_counter() - t1)
    return codec.decode(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxloop.sample", description="Print text generated from a language-model run's checkpoint."
    )
    parser.add_argument("run_dir", help="the run directory of a GPT trained on text or token shards")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument(
        "--length", type=int, default=200, help="tokens to generate (characters of a text run; default 200)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="softmax temperature; 0 = always the most likely token (default 1.0)",
    )
    parser.add_argument(
        "--top_k", type=int, default=None, help="draw only among the K most likely tokens (default all)"
    )
    parser.add_argument(
        "--checkpoint", default="best", help="best (by the run's checkpoint.best_metric) or latest (default best)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a tokenizer.json or a Hugging Face model directory (default: the one the run records)",
    )
    parser.add_argument(
        "--no_kv_cache",
        action="store_true",
        help="run the whole window for every token (the KV cache's reference; slower)",
    )

    def one_line_error(message: str) -> None:
        print(f"jaxloop.sample: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    parser.error = one_line_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    timing: dict[str, float] = {}
    try:
        if args.checkpoint not in ("best", "latest"):
            raise SampleError(f"--checkpoint={args.checkpoint!r} is not allowed: one of best, latest")
        check_options(args.length, args.temperature, args.seed, args.top_k)
        cfg = read_config(args.run_dir)
        codec = run_codec(args.run_dir, cfg, args.tokenizer)
        encode_prompt(codec, args.prompt)
        with precision_scope(cfg):
            loaded = load_params(args.run_dir, args.checkpoint, cfg)
            text = generate(
                run_model(loaded),
                loaded.params,
                codec,
                args.prompt,
                args.length,
                args.temperature,
                args.seed,
                top_k=args.top_k,
                kv_cache=not args.no_kv_cache,
                timing=timing,
                announce=lambda line: print(line, file=sys.stderr, flush=True),
            )
    except SampleError as e:
        print(f"jaxloop.sample: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rate = args.length / timing["generate_s"] if timing["generate_s"] > 0 else float("inf")
    print(
        f"jaxloop.sample: {args.length} tokens from the {loaded.which} checkpoint (update {loaded.step}) of "
        f"{args.run_dir} in {timing['generate_s']:.3f} s, {rate:.1f} tokens/s "
        f"({'no KV cache' if args.no_kv_cache else 'KV cache'}; compiling took {timing['compile_s']:.1f} s more)",
        file=sys.stderr,
    )
    sys.stdout.write(args.prompt + text + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
