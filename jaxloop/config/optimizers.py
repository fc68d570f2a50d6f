"""The optimizers' configs (optim.name): one frozen dataclass per optimizer, holding only the fields it reads,
with its own defaults (torch's; Lion's paper's) and its checks.

Jax-free and torch-free: each framework builds from its own table (jaxloop.update.transforms.BUILDERS,
torch_ref.optim.TORCH_OPTIMIZERS), so this layer imports nothing above it. A new optimizer is a class here (added
to OPTIMIZERS), its transformation in BUILDERS, its torch class in TORCH_OPTIMIZERS, a case in
parity_tests/menu.py and a row in docs/optimizers.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from jaxloop.config.checks import FLOAT32_TINY, at_least, positive, within
from jaxloop.config.choice import Choice, registry
from jaxloop.config.errors import ConfigError


@dataclass(frozen=True)
class OptimizerConfig(Choice):
    """What every optimizer reads besides the rate: weight decay, on matrices and embeddings only."""

    selector: ClassVar[str] = "name"
    bounded: ClassVar[bool] = False
    """Whether its state and update are finite whenever the mean gradient's sum of squares is, so that the
    non-finite skip may decide before running it (jaxloop.update.optimizer)."""

    weight_decay: float = 1e-4
    """Weight decay on matrices and embeddings, never on biases or norm scales: decoupled (scaled by the rate)
    for adamw and lion, added to the gradient (L2, torch's weight_decay) for adam, sgd, rmsprop, adagrad."""

    def validate(self) -> None:
        """ConfigError naming the first field that is not allowed (its flag path, the value, what is)."""
        self.check_types()
        at_least(self.flag("weight_decay"), self.weight_decay, 0)


def _check_eps(cls: type[Choice], eps: float) -> None:
    positive(cls.flag("eps"), eps)
    if eps < FLOAT32_TINY:  # it would round to 0 in float32: Adam's 0 / (sqrt(0) + 0) is NaN
        raise ConfigError(cls.flag("eps"), eps, f"a number >= {FLOAT32_TINY:.4g} (the smallest normal float32)")


def _check_betas(self: Any) -> None:
    for name in ("b1", "b2"):
        within(self.flag(name), getattr(self, name), 0.0, 1.0)


@dataclass(frozen=True)
class AdamWConfig(OptimizerConfig):
    """torch.optim.AdamW: decoupled weight decay (p -= lr * wd * p), exact bias corrections."""

    name: ClassVar[str] = "adamw"
    bounded: ClassVar[bool] = True
    b1: float = 0.9
    """First-moment decay."""
    b2: float = 0.999
    """Second-moment decay."""
    eps: float = 1e-8
    """Epsilon added to the root of the second moment, outside the square root."""

    def validate(self) -> None:
        super().validate()
        _check_betas(self)
        _check_eps(type(self), self.eps)


@dataclass(frozen=True)
class AdamConfig(AdamWConfig):
    """torch.optim.Adam: weight decay as L2 added to the gradient before the moments."""

    name: ClassVar[str] = "adam"


@dataclass(frozen=True)
class SGDConfig(OptimizerConfig):
    """torch.optim.SGD: L2 weight decay, then torch's momentum buffer (it starts as the first gradient)."""

    name: ClassVar[str] = "sgd"
    bounded: ClassVar[bool] = True
    momentum: float = 0.0
    """Momentum (sgd, rmsprop), as torch's: sgd's buffer starts as the first gradient."""
    dampening: float = 0.0
    """sgd: the gradient enters the momentum buffer times (1 - dampening), from the second update on."""
    nesterov: bool = False
    """sgd: Nesterov momentum (needs momentum > 0 and dampening 0, as torch)."""

    def validate(self) -> None:
        super().validate()
        within(self.flag("momentum"), self.momentum, 0.0, 1.0)
        within(self.flag("dampening"), self.dampening, 0.0, 1.0, closed_high=True)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError(
                self.flag("nesterov"),
                self.nesterov,
                f"false unless optim.momentum > 0 and "
                f"optim.dampening = 0 (they are {self.momentum} and {self.dampening}; torch's rule)",
            )


@dataclass(frozen=True)
class RMSpropConfig(OptimizerConfig):
    """torch.optim.RMSprop: eps outside the root, the momentum buffer before the rate."""

    name: ClassVar[str] = "rmsprop"
    alpha: float = 0.99
    """rmsprop: decay of the squared-gradient average."""
    eps: float = 1e-8
    """Epsilon added to the root of the squared-gradient average, outside the square root."""
    momentum: float = 0.0
    """Momentum (sgd, rmsprop), as torch's: sgd's buffer starts as the first gradient."""
    centered: bool = False
    """rmsprop: divide by the root of the gradient's variance estimate instead of its second moment."""

    def validate(self) -> None:
        super().validate()
        within(self.flag("alpha"), self.alpha, 0.0, 1.0)
        _check_eps(type(self), self.eps)
        within(self.flag("momentum"), self.momentum, 0.0, 1.0)


@dataclass(frozen=True)
class AdagradConfig(OptimizerConfig):
    """torch.optim.Adagrad: g / (sqrt(sum) + eps), the sum from initial_accumulator_value, lr_decay."""

    name: ClassVar[str] = "adagrad"
    lr_decay: float = 0.0
    """adagrad: the rate of update t (1-based) is divided by 1 + (t - 1) * lr_decay."""
    initial_accumulator_value: float = 0.0
    """adagrad: starting value of the sum of squared gradients."""
    eps: float = 1e-10
    """Epsilon added to the root of the sum, outside the square root (torch's Adagrad default)."""

    def validate(self) -> None:
        super().validate()
        at_least(self.flag("lr_decay"), self.lr_decay, 0)
        at_least(self.flag("initial_accumulator_value"), self.initial_accumulator_value, 0)
        _check_eps(type(self), self.eps)


@dataclass(frozen=True)
class LionConfig(OptimizerConfig):
    """Lion (the paper's, optax.lion; torch has none: torch_ref.lion), decoupled weight decay."""

    name: ClassVar[str] = "lion"
    bounded: ClassVar[bool] = True
    b1: float = 0.9
    """The interpolation between the momentum and the gradient whose sign is the update (the paper's beta1)."""
    b2: float = 0.99
    """The momentum's decay (the paper's and lion-pytorch's beta2)."""

    def validate(self) -> None:
        super().validate()
        _check_betas(self)


OPTIMIZERS: dict[str, type[OptimizerConfig]] = registry(  # type: ignore[assignment]
    AdamWConfig, AdamConfig, SGDConfig, RMSpropConfig, AdagradConfig, LionConfig
)
"""optim.name -> its config class: the one list of optimizers (the CLI's choices, the docs' table)."""
