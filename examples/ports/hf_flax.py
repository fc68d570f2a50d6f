"""Hugging Face transformers' own Flax ports against their PyTorch originals (transformers 4.57.x, the last
release with Flax models), as jaxloop.parity Ports: a corpus of ports nobody on this project wrote.

    python -m jaxloop.parity examples/ports/hf_flax.py:bert --no-trajectory

Each family is built twice from one tiny random config (hidden 32, 2 layers, 4 heads; no download):
transformers' torch model with random weights (every 1-d weight moved off its 1/0 start, so that the
forward pass depends on each), and its Flax module (`FlaxXModel(config, _do_init=False).module`), as
Hugging Face ships them: the default dropout, the Flax modules' default dtype=jnp.float32 (the port
check pins it to the checked precision, with a note). The Flax module is fed as its Hugging Face
wrapper feeds it (position ids, token types, NCHW pixels moved to NHWC). `make(family,
flax_config=...)` builds the Flax side from a changed config (a planted port bug).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxloop.parity import Port

BATCH, TOKENS, VOCAB, IMAGE = 2, 8, 64, 32
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=32,
)


@dataclass(frozen=True)
class Family:
    config: str  # transformers config class
    torch: str  # transformers torch model class
    flax: str  # its Flax counterpart
    settings: dict[str, Any]
    inputs: str = "text"  # "text": token ids and a padding mask; "image": NCHW pixels
    positions: Callable[[Any, Any, Any], Any] | None = (
        None  # (ids, mask, config) -> position ids, as the wrapper makes them
    )


def _roberta_positions(ids: Any, mask: Any, config: Any) -> Any:
    from transformers.models.roberta.modeling_flax_roberta import (
        create_position_ids_from_input_ids,
    )

    return create_position_ids_from_input_ids(ids, config.pad_token_id)


def _opt_positions(ids: Any, mask: Any, config: Any) -> Any:
    return (mask.cumsum(axis=1) * mask) - 1  # FlaxOPTModel's own


FAMILIES: dict[str, Family] = {
    "bert": Family("BertConfig", "BertModel", "FlaxBertModel", TEXT),
    "roberta": Family("RobertaConfig", "RobertaModel", "FlaxRobertaModel", TEXT, positions=_roberta_positions),
    "electra": Family("ElectraConfig", "ElectraModel", "FlaxElectraModel", {**TEXT, "embedding_size": 32}),
    "distilbert": Family(
        "DistilBertConfig",
        "DistilBertModel",
        "FlaxDistilBertModel",
        dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=32),
    ),
    "albert": Family("AlbertConfig", "AlbertModel", "FlaxAlbertModel", {**TEXT, "embedding_size": 16}),
    "gpt2": Family(
        "GPT2Config",
        "GPT2LMHeadModel",
        "FlaxGPT2LMHeadModel",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    ),
    "gpt_neo": Family(
        "GPTNeoConfig",
        "GPTNeoModel",
        "FlaxGPTNeoModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        ),
    ),
    "opt": Family(
        "OPTConfig",
        "OPTModel",
        "FlaxOPTModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=37,
            max_position_embeddings=32,
            word_embed_proj_dim=32,
        ),
        positions=_opt_positions,
    ),
    "vit": Family(
        "ViTConfig",
        "ViTForImageClassification",
        "FlaxViTForImageClassification",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            image_size=IMAGE,
            patch_size=8,
            num_labels=10,
        ),
        "image",
    ),
    "beit": Family(
        "BeitConfig",
        "BeitForImageClassification",
        "FlaxBeitForImageClassification",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            image_size=IMAGE,
            patch_size=8,
            num_labels=10,
            use_mean_pooling=True,
        ),
        "image",
    ),
    "resnet": Family(
        "ResNetConfig",
        "ResNetForImageClassification",
        "FlaxResNetForImageClassification",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=10),
        "image",
    ),
    "regnet": Family(
        "RegNetConfig",
        "RegNetForImageClassification",
        "FlaxRegNetForImageClassification",
        dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8, layer_type="y", num_labels=10),
        "image",
    ),
}


def config(family: str, **changes: Any) -> Any:
    """The family's tiny config (transformers' class), with `changes` applied."""
    import transformers

    f = FAMILIES[family]
    return getattr(transformers, f.config)(**{**f.settings, **changes})


def torch_model(family: str, seed: int = 0) -> Any:
    """transformers' torch model from the tiny config: torch's init, then every 1-d weight moved off its start."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family].torch)(config(family))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def flax_module(family: str, **config_changes: Any) -> Any:
    """transformers' Flax module (Linen) for the family, from the tiny config with `config_changes`."""
    import transformers

    return getattr(transformers, FAMILIES[family].flax)(config(family, **config_changes), _do_init=False).module


def batch(family: str, i: int = 0) -> dict[str, np.ndarray]:
    """Batch i: token ids with a padding mask (the second sequence's last two tokens padded), or NCHW pixels."""
    rng = np.random.default_rng(1000 + i)
    if FAMILIES[family].inputs == "image":
        return {"x": rng.normal(size=(BATCH, 3, IMAGE, IMAGE)).astype(np.float32)}
    mask = np.ones((BATCH, TOKENS), np.int64)
    mask[1, -2:] = 0
    return {"x": rng.integers(2, VOCAB, (BATCH, TOKENS)), "mask": mask}


def torch_loss(model: Any, b: dict[str, Any]) -> Any:
    """0.5 mean(out^2) of the model's first output (last hidden state or logits)."""
    if "mask" in b:
        out = model(input_ids=b["x"], attention_mask=b["mask"])
    else:
        out = model(pixel_values=b["x"])
    return 0.5 * (out[0] ** 2).mean()


def flax_loss_of(family: str, cfg: Any) -> Callable[[Any, dict, bool], tuple[Any, dict]]:
    """The Flax loss: the module called as its Hugging Face wrapper calls it, then torch_loss's formula."""
    f = FAMILIES[family]

    def loss(model: Any, b: dict[str, Any], train: bool) -> tuple[Any, dict]:
        if f.inputs == "image":
            out = model(jnp.transpose(b["x"], (0, 2, 3, 1)), deterministic=not train)
        else:
            ids, mask = b["x"], b["mask"]
            kwargs: dict[str, Any] = {"attention_mask": mask, "deterministic": not train}
            params = inspect.signature(_module_class(family).__call__).parameters
            if "token_type_ids" in params:
                kwargs["token_type_ids"] = jnp.zeros_like(ids)
            if "position_ids" in params:
                kwargs["position_ids"] = (
                    f.positions(ids, mask, cfg)
                    if f.positions is not None
                    else jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
                )
            if "head_mask" in params:
                kwargs["head_mask"] = None
            out = model(ids, **kwargs)
        return 0.5 * jnp.mean(out[0] ** 2), {}

    return loss


def _module_class(family: str) -> type:
    import transformers

    return getattr(transformers, FAMILIES[family].flax).module_class


def make(family: str = "bert", flax_config: dict[str, Any] | None = None) -> Port:
    """The pair for a family; `flax_config`: config changes on the Flax side only (a planted port bug)."""
    tm = torch_model(family)
    cfg = config(family, **(flax_config or {}))
    return Port(
        tm,
        flax_module(family, **(flax_config or {})),
        batch(family),
        torch_loss,
        flax_loss_of(family, cfg),
        batches=lambda i: batch(family, i),
        name=f"transformers {family}: torch vs Hugging Face's Flax port",
    )


def _factory(family: str) -> Callable[[], Port]:
    def factory() -> Port:
        return make(family)

    factory.__name__ = family
    factory.__doc__ = f"make({family!r}), for `python -m jaxloop.parity examples/ports/hf_flax.py:{family}`."
    return factory


bert, roberta, electra, distilbert, albert, gpt2, gpt_neo, opt, vit, beit, resnet, regnet = (
    _factory(name) for name in FAMILIES
)
