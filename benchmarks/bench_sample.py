"""`sample.gpt`: generating text with the KV cache against without it, on the same GPT, params and prompt.

Both contenders are jaxloop.sample's own compiled generation (make_generate: one jitted lax.scan), the only
difference being kv_cache: with it the prompt's window runs once and each new token is one one-token step
against the cache; without it every new token runs the whole window. The prompt (8 tokens) and the
generated text fit the context, the cache's case: N tokens cost one window and N one-token steps, against N
windows. Rounds are interleaved (common.interleaved) and the row prints the medians' ratio and the spread.
Beside them (extra, notes): a second end-to-end `jaxloop.sample.generate` call of the same model and options, as a
hook sampling at every evaluation makes it, against the compiled call alone (the first call compiles; the second
should cost the call, not a compile).
"""

from __future__ import annotations

import time

from benchmarks.common import Options, Row, interleaved, median

SHAPE = {"n_layers": 4, "n_heads": 4, "d_model": 128, "context": 256}
"""A small GPT with a context long enough for the cache to matter (the whole-window cost grows with it)."""
SMOKE = {"n_layers": 1, "n_heads": 2, "d_model": 16, "context": 16}
PROMPT = 8


def sample_row(opts: Options) -> Row:
    row = Row("sample.gpt", "text generation, KV cache vs whole window per token (jaxloop.sample)", unit="tokens/s")
    try:
        import jax
        import numpy as np

        from jaxloop.config.run import ModelConfig
        from jaxloop.model.builtin import make_model
        from jaxloop.sample import generate, make_generate

        shape = SMOKE if opts.smoke else SHAPE
        vocab = 65  # Tiny Shakespeare's characters
        model = make_model(ModelConfig(kind="gpt", **shape, dropout=0.0), vocab, "fp32")
        tokens = np.zeros((1, shape["context"]), np.int32)
        params = jax.jit(lambda k: model.init(k, tokens, train=False))(jax.random.PRNGKey(0))["params"]
        length = shape["context"] - PROMPT  # prompt and text fill the window: no step past the cache's end
        buf = np.zeros(shape["context"], np.int32)
        buf[:PROMPT] = np.arange(1, PROMPT + 1)
        key = jax.random.PRNGKey(1)
        gens = {
            name: make_generate(model, shape["context"], length, vocab, kv_cache=cached)
            for name, cached in (("kv cache", True), ("whole window", False))
        }
        ids = {}
        for name, gen in gens.items():  # compile, and the tokens each gives at temperature 0
            ids[name] = np.asarray(jax.device_get(gen(params, buf, PROMPT, key, 0.0)))

        def timed(gen) -> float:
            t0 = time.perf_counter()
            gen(params, buf, PROMPT, key, 0.0).block_until_ready()  # host-device sync: the generation's end
            return (time.perf_counter() - t0) / length

        per_token = interleaved(
            {name: (lambda g=g: timed(g)) for name, g in gens.items()}, rounds=1 if opts.smoke else 5
        )
        rate = {name: 1.0 / median(ts) for name, ts in per_token.items()}
        chars = [chr(33 + i) for i in range(vocab)]  # a codec of the model's vocabulary
        prompt = "".join(chars[i] for i in range(1, PROMPT + 1))
        generate(model, params, chars, prompt, length=length, temperature=0.0)  # the first call compiles
        t0 = time.perf_counter()
        generate(model, params, chars, prompt, length=length, temperature=0.0)  # decoded: the host has the ids
        again = time.perf_counter() - t0
        call = median(per_token["kv cache"]) * length
        row.jax, row.ref = rate["kv cache"], rate["whole window"]
        row.ratio = row.jax / row.ref
        row.check(">=", 2.0)
        spread = {name: [round(1.0 / t, 1) for t in sorted(ts)] for name, ts in per_token.items()}
        row.extra = {
            "tokens_per_s": spread,
            "length": length,
            "shape": shape,
            "same_tokens": bool((ids["kv cache"] == ids["whole window"]).all()),
            "generate_again_s": round(again, 4),
            "compiled_call_s": round(call, 4),
        }
        row.notes = (
            f"{shape['n_layers']} layers, width {shape['d_model']}, context {shape['context']}; "
            f"{length} tokens after an {PROMPT}-token prompt, temperature 0, fp32; same tokens: "
            f"{row.extra['same_tokens']}; tokens/s per round: {spread}; a second generate() call end to end "
            f"{again:.3f} s against the compiled call's {call:.3f} s"
        )
    except Exception as e:  # noqa: BLE001 - a row that fails prints as failed; the others still run
        row.status, row.notes = "failed", f"{type(e).__name__}: {e}"
    return row
