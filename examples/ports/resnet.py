"""Hugging Face transformers' ResNet and a Flax Linen translation of it, checked against each other.

    python -m jaxloop.parity examples/ports/resnet.py:make

The torch side is transformers' own ResNetForImageClassification (basic layers, BatchNorm after every
convolution, a strided 7x7 stem, max pooling, strided 1x1 shortcuts, average pooling, a linear head),
built from a small config with random weights (no download). Batches are NCHW for torch; the Flax
loss moves them to NHWC. Three conventions a port must get right here: explicit conv padding (k // 2
on each side; 'SAME' pads a strided conv differently), BatchNorm's momentum (torch's 0.1 is Flax's 0.9)
and its running variance, which torch updates with the unbiased batch variance (Flax's own
BatchNorm uses the biased one, so the port carries its own BatchNorm below).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from jaxloop.parity import Port

IMAGE, CHANNELS, CLASSES, BATCH = 32, 3, 10, 8


@dataclass(frozen=True)
class Settings:
    embedding_size: int = 8
    hidden_sizes: tuple[int, ...] = (8, 16)
    depths: tuple[int, ...] = (1, 1)
    num_labels: int = CLASSES
    downsample_in_first_stage: bool = False
    bn_momentum: float = 0.9  # Flax convention (new = momentum old + (1 - momentum) batch): torch's 0.1
    bn_epsilon: float = 1e-5
    batch_norm: str = "torch"  # "torch": running variance with n/(n-1) as torch; "flax": flax.linen.BatchNorm
    conv_padding: str = "torch"  # "torch": k // 2 on each side; "SAME": Flax's 'SAME'

    @classmethod
    def of(cls, config: Any, **changes: Any) -> Settings:
        return replace(
            cls(
                config.embedding_size,
                tuple(config.hidden_sizes),
                tuple(config.depths),
                config.num_labels,
                config.downsample_in_first_stage,
            ),
            **changes,
        )


class BatchNorm(nn.Module):
    """torch.nn.BatchNorm2d in Flax: batch statistics (biased variance) in train mode; running statistics
    updated with momentum (Flax's convention) from the batch mean and the *unbiased* batch variance."""

    momentum: float = 0.9
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (c,))
        bias = self.param("bias", nn.initializers.zeros, (c,))
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), x.dtype))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((c,), x.dtype))
        if train:
            mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
            if not self.is_initializing():
                n = x.size // c
                ra_mean.value = self.momentum * ra_mean.value + (1 - self.momentum) * mean
                ra_var.value = self.momentum * ra_var.value + (1 - self.momentum) * var * (n / (n - 1))
        else:
            mean, var = ra_mean.value, ra_var.value
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias


class ConvLayer(nn.Module):
    s: Settings
    features: int
    kernel: int = 3
    stride: int = 1
    relu: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        s, k = self.s, self.kernel
        padding = "SAME" if s.conv_padding == "SAME" else ((k // 2, k // 2), (k // 2, k // 2))
        x = nn.Conv(
            self.features, (k, k), (self.stride, self.stride), padding=padding, use_bias=False, name="convolution"
        )(x)
        if s.batch_norm == "flax":
            x = nn.BatchNorm(
                use_running_average=not train, momentum=s.bn_momentum, epsilon=s.bn_epsilon, name="normalization"
            )(x)
        else:
            x = BatchNorm(s.bn_momentum, s.bn_epsilon, name="normalization")(x, train)
        return nn.relu(x) if self.relu else x


class ShortCut(nn.Module):
    s: Settings
    features: int
    stride: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(
            self.features, (1, 1), (self.stride, self.stride), padding="VALID", use_bias=False, name="convolution"
        )(x)
        if self.s.batch_norm == "flax":
            return nn.BatchNorm(
                use_running_average=not train,
                momentum=self.s.bn_momentum,
                epsilon=self.s.bn_epsilon,
                name="normalization",
            )(x)
        return BatchNorm(self.s.bn_momentum, self.s.bn_epsilon, name="normalization")(x, train)


class BasicLayer(nn.Module):
    s: Settings
    features: int
    stride: int = 1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        residual = x
        h = ConvLayer(self.s, self.features, stride=self.stride, name="layer_0")(x, train)
        h = ConvLayer(self.s, self.features, relu=False, name="layer_1")(h, train)
        if x.shape[-1] != self.features or self.stride != 1:
            residual = ShortCut(self.s, self.features, self.stride, name="shortcut")(x, train)
        return nn.relu(h + residual)


class Stage(nn.Module):
    s: Settings
    features: int
    stride: int
    depth: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for i in range(self.depth):
            x = BasicLayer(self.s, self.features, self.stride if i == 0 else 1, name=f"layers_{i}")(x, train)
        return x


class Embeddings(nn.Module):
    s: Settings

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = ConvLayer(self.s, self.s.embedding_size, kernel=7, stride=2, name="embedder")(x, train)
        return nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))


class ResNetForImageClassification(nn.Module):
    """Logits [batch, classes] for NHWC images."""

    s: Settings

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        s = self.s
        x = Embeddings(s, name="embedder")(x, train)
        sizes = (s.embedding_size,) + s.hidden_sizes
        for i, depth in enumerate(s.depths):
            stride = 2 if (i > 0 or s.downsample_in_first_stage) else 1
            x = Stage(s, sizes[i + 1], stride, depth, name=f"stages_{i}")(x, train)
        return nn.Dense(s.num_labels, name="classifier")(x.mean((1, 2)))


def torch_model(seed: int = 0) -> Any:
    """transformers' ResNetForImageClassification from a small config: torch's init, BatchNorm scales and
    biases moved off 1 and 0, and running statistics from three train-mode passes over random images."""
    import torch
    from transformers import ResNetConfig
    from transformers import ResNetForImageClassification as TorchResNet

    torch.manual_seed(seed)
    config = ResNetConfig(
        num_channels=CHANNELS,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=CLASSES,
    )
    model = TorchResNet(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "normalization" in name:
                p.add_(0.2 * torch.randn_like(p))
        model.train()
        for i in range(3):
            model(torch.from_numpy(batch(100 + i)["x"]))
    model.eval()
    return model


def batch(i: int, batch_size: int = BATCH) -> dict[str, np.ndarray]:
    """Batch i: random NCHW images x and labels y."""
    rng = np.random.default_rng(2000 + i)
    return {
        "x": rng.normal(size=(batch_size, CHANNELS, IMAGE, IMAGE)).astype(np.float32),
        "y": rng.integers(0, CLASSES, batch_size),
    }


def torch_loss(model: Any, b: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(pixel_values=b["x"]).logits, b["y"])


def flax_loss(model: Any, b: dict[str, jax.Array], train: bool) -> tuple[jax.Array, dict]:
    logits = model(jnp.transpose(b["x"], (0, 2, 3, 1)), train=train)  # NCHW -> NHWC
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), {}


def make(**flax_changes: Any) -> Port:
    """The pair: transformers' ResNet and the Flax port (with `flax_changes` applied to its Settings)."""
    tm = torch_model()
    return Port(
        tm,
        ResNetForImageClassification(Settings.of(tm.config, **flax_changes)),
        batch(0),
        torch_loss,
        flax_loss,
        batches=batch,
        name="transformers ResNet (2 stages, 32x32 images) vs a Flax Linen port",
    )
