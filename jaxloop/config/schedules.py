"""The learning-rate schedules' configs (optim.schedule): one frozen dataclass per schedule, holding only the
fields it reads, their checks, and its rate function (`build(peak_lr, steps)`: update u -> its float64 rate;
the formulas and their notation: jaxloop.update.schedules' module doc).

Jax-free and numpy-free (Python floats): the CLI, jaxloop.update.schedules (which tabulates `build`'s rates) and
torch_ref.schedule (which maps each class to torch's scheduler class) read them. A new schedule is a class
here (added to SCHEDULES), its torch class in torch_ref.schedule and a row in docs/optimizers.md.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from jaxloop.config.checks import at_least, is_int, positive, within
from jaxloop.config.choice import Choice, registry
from jaxloop.config.errors import ConfigError


def _sin2(num: float, den: float) -> float:
    """sin^2(pi/2 * num / den): (1 + cos(pi t)) / 2 with 1 - t = num / den."""
    s = math.sin(0.5 * math.pi * (num / den))
    return s * s


@dataclass(frozen=True)
class ScheduleConfig(Choice):
    """A learning-rate schedule: the rate of each 0-based optimizer update from peak_lr and steps."""

    selector: ClassVar[str] = "schedule"

    def validate(self, peak_lr: float, steps: int) -> None:
        """ConfigError naming the first field that is not allowed, for a run of `steps` updates."""
        self.check_types()

    def rate(self, u: int, peak_lr: float, steps: int) -> float:
        """The float64 rate of update u in 0 .. steps (the last is held past steps)."""
        raise NotImplementedError

    def build(self, peak_lr: float, steps: int) -> Callable[[int], float]:
        """The rate function: update u (0 .. steps; held past steps) -> its float64 rate."""
        return lambda u: self.rate(min(u, steps), peak_lr, steps)


@dataclass(frozen=True)
class WarmupScheduleConfig(ScheduleConfig):
    """A schedule after a linear warmup init_lr -> peak_lr, counting its own updates from the warmup's end (as
    the second scheduler of torch's SequentialLR)."""

    init_lr: float = 0.0
    """Learning rate of the first update (start of the linear warmup)."""
    warmup_steps: int = 50
    """Updates of linear warmup from init_lr to peak_lr before the schedule (0 = start at peak_lr); the
    schedule's own update count starts after it, as inside torch's SequentialLR."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        at_least(self.flag("init_lr"), self.init_lr, 0)
        at_least(self.flag("warmup_steps"), self.warmup_steps, 0)
        if self.init_lr > peak_lr:
            raise ConfigError(self.flag("init_lr"), self.init_lr, f"at most optim.peak_lr ({peak_lr})")
        end_lr = getattr(self, "end_lr", None)
        if end_lr is not None:
            at_least(self.flag("end_lr"), end_lr, 0)
            if end_lr > peak_lr:
                raise ConfigError(self.flag("end_lr"), end_lr, f"at most optim.peak_lr ({peak_lr})")
        if self.warmup_steps > steps:
            raise ConfigError(self.flag("warmup_steps"), self.warmup_steps, f"an integer in [0, steps={steps}]")

    def rate(self, u: int, peak_lr: float, steps: int) -> float:
        if u < self.warmup_steps:
            return self.init_lr + (peak_lr - self.init_lr) * (u / self.warmup_steps)
        return self.after_warmup(u - self.warmup_steps, peak_lr, steps)

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        """The rate v updates after the warmup."""
        raise NotImplementedError

    def _decay_span_at_least_one(self, steps: int) -> None:
        if steps - self.warmup_steps < 1:
            raise ConfigError(
                self.flag("warmup_steps"),
                self.warmup_steps,
                f"less than steps ({steps}) for optim.schedule={self.name}, which decays over the updates after warmup",
            )


@dataclass(frozen=True)
class WarmupCosineConfig(WarmupScheduleConfig):
    """Cosine from peak_lr to end_lr at steps (the closed form; torch_ref: LambdaLR of it)."""

    name: ClassVar[str] = "warmup_cosine"
    end_lr: float = 3e-5
    """The floor: warmup_cosine's and cosine_restarts' eta_min, linear's and wsd's final rate, held past steps."""

    def rate(self, u: int, peak_lr: float, steps: int) -> float:
        if u < self.warmup_steps:
            return super().rate(u, peak_lr, steps)
        if self.warmup_steps == steps:
            return self.end_lr
        return self.end_lr + (peak_lr - self.end_lr) * _sin2(steps - u, steps - self.warmup_steps)


@dataclass(frozen=True)
class ConstantConfig(WarmupScheduleConfig):
    """peak_lr after the warmup (torch's ConstantLR(factor=1))."""

    name: ClassVar[str] = "constant"

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        return peak_lr


@dataclass(frozen=True)
class LinearConfig(WarmupScheduleConfig):
    """Linear from peak_lr to end_lr over the updates after warmup (torch's LinearLR)."""

    name: ClassVar[str] = "linear"
    end_lr: float = 3e-5
    """The floor: warmup_cosine's and cosine_restarts' eta_min, linear's and wsd's final rate, held past steps."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        self._decay_span_at_least_one(steps)

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        P, E, D = peak_lr, self.end_lr, steps - self.warmup_steps
        return E + (P - E) * ((D - min(v, D)) / D)


@dataclass(frozen=True)
class PolynomialConfig(WarmupScheduleConfig):
    """peak_lr * (1 - t / (steps - warmup_steps)) ** power, to 0 (torch's PolynomialLR)."""

    name: ClassVar[str] = "polynomial"
    power: float = 1.0
    """polynomial: the rate is peak_lr * (1 - t / (steps - warmup_steps)) ** power."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        at_least(self.flag("power"), self.power, 0)
        self._decay_span_at_least_one(steps)

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        D = steps - self.warmup_steps
        return peak_lr * ((D - min(v, D)) / D) ** self.power


def _needs(cls: Choice, field: str, ok: bool, allowed: str) -> None:
    """The error for a field the schedule needs set (its default does not run)."""
    if not ok:
        raise ConfigError(cls.flag(field), getattr(cls, field), f"{allowed} (optim.schedule={cls.name})")


@dataclass(frozen=True)
class StepConfig(WarmupScheduleConfig):
    """peak_lr * gamma ** (v // step_size) (torch's StepLR)."""

    name: ClassVar[str] = "step"
    step_size: int = 0
    """step: multiply the rate by gamma every step_size updates (after warmup)."""
    gamma: float = 0.1
    """step, multistep, exponential: the multiplicative factor."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        positive(self.flag("gamma"), self.gamma)
        at_least(self.flag("step_size"), self.step_size, 0)
        _needs(self, "step_size", self.step_size >= 1, "an integer >= 1")

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        return peak_lr * self.gamma ** (v // self.step_size)


@dataclass(frozen=True)
class MultiStepConfig(WarmupScheduleConfig):
    """peak_lr * gamma ** (number of milestones <= v) (torch's MultiStepLR)."""

    name: ClassVar[str] = "multistep"
    milestones: tuple[int, ...] = ()
    """multistep: updates (counted after warmup) at which the rate is multiplied by gamma, increasing."""
    gamma: float = 0.1
    """step, multistep, exponential: the multiplicative factor."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        positive(self.flag("gamma"), self.gamma)
        m = self.milestones
        if not all(is_int(x) and x > 0 for x in m) or list(m) != sorted(set(m)):
            raise ConfigError(self.flag("milestones"), m, "increasing positive integers")
        _needs(self, "milestones", len(m) > 0, "one or more increasing positive integers")

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        return peak_lr * self.gamma ** bisect_right(self.milestones, v)


@dataclass(frozen=True)
class ExponentialConfig(WarmupScheduleConfig):
    """peak_lr * gamma ** v (torch's ExponentialLR)."""

    name: ClassVar[str] = "exponential"
    gamma: float = 0.1
    """step, multistep, exponential: the multiplicative factor."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        positive(self.flag("gamma"), self.gamma)

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        return peak_lr * self.gamma**v


@dataclass(frozen=True)
class CosineRestartsConfig(WarmupScheduleConfig):
    """Cosine cycles of t_0, t_0 t_mult, ... updates from peak_lr to end_lr (CosineAnnealingWarmRestarts)."""

    name: ClassVar[str] = "cosine_restarts"
    t_0: int = 0
    """cosine_restarts: updates of the first cosine cycle (from peak_lr to end_lr)."""
    t_mult: int = 1
    """cosine_restarts: each cycle is t_mult times as long as the previous."""
    end_lr: float = 3e-5
    """The floor: warmup_cosine's and cosine_restarts' eta_min, linear's and wsd's final rate, held past steps."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        at_least(self.flag("t_0"), self.t_0, 0)
        positive(self.flag("t_mult"), self.t_mult)
        _needs(self, "t_0", self.t_0 >= 1, "an integer >= 1")

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        t_cur, t_i = v, self.t_0  # (T_cur, T_i) after v updates of CosineAnnealingWarmRestarts(T_0, T_mult)
        while t_cur >= t_i:
            t_cur, t_i = t_cur - t_i, t_i * self.t_mult
        return self.end_lr + (peak_lr - self.end_lr) * _sin2(t_i - t_cur, t_i)


@dataclass(frozen=True)
class OneCycleConfig(ScheduleConfig):
    """torch's OneCycleLR over the whole run (no warmup of ours), the rate only (cycle_momentum=False)."""

    name: ClassVar[str] = "one_cycle"
    pct_start: float = 0.3
    """one_cycle: fraction of steps spent increasing the rate."""
    div_factor: float = 25.0
    """one_cycle: the first rate is peak_lr / div_factor."""
    final_div_factor: float = 1e4
    """one_cycle: the last rate is peak_lr / div_factor / final_div_factor."""
    three_phase: bool = False
    """one_cycle: torch's three-phase form (up, back down to the first rate, then to the last rate)."""
    anneal_strategy: Literal["cos", "linear"] = "cos"
    """one_cycle: cosine or linear annealing within each phase."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        p = self.flag("pct_start")
        if not 0.0 < self.pct_start < 1.0:
            raise ConfigError(p, self.pct_start, "a number in (0, 1)")
        positive(self.flag("div_factor"), self.div_factor)
        positive(self.flag("final_div_factor"), self.final_div_factor)
        # torch's phase ends: pct_start * steps - 1 (and 2 * pct_start * steps - 2), each after the previous
        up = self.pct_start * steps - 1
        if up <= 0:
            raise ConfigError(
                p,
                self.pct_start,
                f"more than 1 / steps = {1 / steps:.4g} (one_cycle's rising phase must hold at least one update)",
            )
        if self.three_phase and not up < 2 * self.pct_start * steps - 2 < steps - 1:
            raise ConfigError(
                p,
                self.pct_start,
                f"in ({1 / steps:.4g}, {(steps + 1) / (2 * steps):.4g}) for three_phase (three non-empty phases)",
            )

    def rate(self, u: int, peak_lr: float, steps: int) -> float:
        """torch's OneCycleLR at update min(u, steps - 1) (its phase ends and endpoints, cancellation-free)."""
        u = min(u, steps - 1)
        initial = peak_lr / self.div_factor
        low = initial / self.final_div_factor
        up = float(self.pct_start * steps) - 1
        phases = (
            [
                (up, initial, peak_lr),
                (float(2 * self.pct_start * steps) - 2, peak_lr, initial),
                (steps - 1, initial, low),
            ]
            if self.three_phase
            else [(up, initial, peak_lr), (steps - 1, peak_lr, low)]
        )
        start = 0.0
        for i, (end, a, b) in enumerate(phases):
            if u <= end or i == len(phases) - 1:
                left = (end - u) / (end - start)  # 1 - the fraction of the phase done
                return b + (a - b) * (_sin2(end - u, end - start) if self.anneal_strategy == "cos" else left)
            start = end
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class WSDConfig(WarmupScheduleConfig):
    """Warmup-stable-decay: peak_lr, then the last decay_steps updates down to end_lr (Hugging Face's)."""

    name: ClassVar[str] = "wsd"
    decay_steps: int = 0
    """wsd: the final updates over which the rate decays from peak_lr to end_lr (the rest is stable)."""
    decay_type: Literal["linear", "cosine", "1-sqrt"] = "cosine"
    """wsd: the decay's shape (Hugging Face's decay_type)."""
    end_lr: float = 3e-5
    """The floor: warmup_cosine's and cosine_restarts' eta_min, linear's and wsd's final rate, held past steps."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        at_least(self.flag("decay_steps"), self.decay_steps, 0)
        span = steps - self.warmup_steps
        _needs(self, "decay_steps", 1 <= self.decay_steps <= span, f"an integer in [1, steps - warmup_steps = {span}]")

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        n = self.decay_steps
        k = v - (steps - self.warmup_steps - n)  # updates into the decay
        if k <= 0:
            return peak_lr
        k = min(k, n)
        if self.decay_type == "linear":
            f = (n - k) / n
        elif self.decay_type == "cosine":
            f = _sin2(n - k, n)
        else:  # 1-sqrt: 1 - sqrt(k / n) = (1 - k / n) / (1 + sqrt(k / n))
            f = ((n - k) / n) / (1.0 + math.sqrt(k / n))
        return self.end_lr + (peak_lr - self.end_lr) * f


@dataclass(frozen=True)
class InverseSqrtConfig(WarmupScheduleConfig):
    """peak_lr / sqrt((v + timescale) / timescale) after warmup (Hugging Face's get_inverse_sqrt_schedule)."""

    name: ClassVar[str] = "inverse_sqrt"
    timescale: int = 0
    """inverse_sqrt: after warmup the rate is peak_lr / sqrt((t + timescale) / timescale), t counted after
    warmup (0 = warmup_steps, or 10000 without warmup, as Hugging Face's)."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        at_least(self.flag("timescale"), self.timescale, 0)

    def effective_timescale(self) -> int:
        """timescale, or warmup_steps, or 10000 (Hugging Face's default)."""
        return self.timescale or self.warmup_steps or 10_000

    def after_warmup(self, v: int, peak_lr: float, steps: int) -> float:
        timescale = self.effective_timescale()
        return peak_lr / math.sqrt((v + timescale) / timescale)


@dataclass(frozen=True)
class PlateauConfig(ScheduleConfig):
    """ReduceLROnPlateau (optim.schedule=plateau): at each evaluation checkpoint.best_metric, by
    checkpoint.best_mode, decides whether the rate is multiplied by `factor` (torch's rule and names)."""

    name: ClassVar[str] = "plateau"
    prefix: ClassVar[str] = "plateau."
    factor: float = 0.1
    """Multiply the rate by this after more than `patience` evaluations without improvement."""
    patience: int = 10
    """Evaluations without improvement tolerated before a reduction."""
    threshold: float = 1e-4
    """How much better counts as better (relative or absolute: threshold_mode)."""
    threshold_mode: Literal["rel", "abs"] = "rel"
    """rel: better than best * (1 -/+ threshold); abs: better than best -/+ threshold."""
    cooldown: int = 0
    """Evaluations after a reduction during which bad evaluations are not counted."""
    min_lr: float = 0.0
    """The rate is never reduced below this."""
    eps: float = 1e-8
    """A reduction smaller than this (absolute) is not made."""

    def validate(self, peak_lr: float, steps: int) -> None:
        super().validate(peak_lr, steps)
        within(self.flag("factor"), self.factor, 0.0, 1.0)
        for name in ("patience", "threshold", "cooldown", "min_lr", "eps"):
            at_least(self.flag(name), getattr(self, name), 0)

    def rate(self, u: int, peak_lr: float, steps: int) -> float:
        """peak_lr: the reductions are host decisions at evaluations (jaxloop.loop.plateau)."""
        return peak_lr


SCHEDULES: dict[str, type[ScheduleConfig]] = registry(  # type: ignore[assignment]
    WarmupCosineConfig,
    ConstantConfig,
    LinearConfig,
    StepConfig,
    MultiStepConfig,
    PolynomialConfig,
    ExponentialConfig,
    CosineRestartsConfig,
    OneCycleConfig,
    WSDConfig,
    InverseSqrtConfig,
    PlateauConfig,
)
"""optim.schedule -> its config class: the one list of schedules."""

WARMUP_FIELDS = tuple(f for f in WarmupScheduleConfig.field_names())
"""The warmup's fields (init_lr, warmup_steps), read by every schedule but one_cycle and plateau."""
