"""Training, not only inference: gradients, optimizer updates and a trajectory, jaxloop's against torch's.

Gradients: one train-mode backward pass on each side (dropout off), torch's moved into the Flax
layout through the weight mapping, compared tensor by tensor. Updates: jaxloop's optimizer
(`jaxloop.make_optimizer`) and torch's (torch_ref's optimizer, scheduler and clipping: torch's own
classes, as parity_tests holds them) applied `n` times to the same gradients (the Flax ones, mapped back into torch's
layout), varied elementwise from update to update (`varied`: a constant gradient would leave Adam's
bias-corrected moments equal to it, blind to b1 and b2, and clipping removes a mere scale), for each
OptimConfig of `update_configs`. Trajectory: `n` updates of `jaxloop.make_train_step`
on a `jaxloop.TrainState` against a plain torch loop (zero_grad, backward, clip, step, scheduler step)
on the same batches in the same order, losses and params compared after every update.

Clipping on the torch side follows optax's rule (g unchanged below the norm, (g / norm) clip above):
torch's clip_grad_norm_ divides by norm + 1e-6, a difference of 1e-6 / norm that would hide a float64
comparison (torch_ref.optim.clip_gradients documents both; parity_tests measures the torch rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
import optax

from jaxloop.config.optimizers import AdagradConfig, AdamConfig, AdamWConfig, LionConfig, RMSpropConfig, SGDConfig
from jaxloop.config.run import Config, OptimConfig
from jaxloop.config.schedules import (
    ConstantConfig,
    CosineRestartsConfig,
    ExponentialConfig,
    InverseSqrtConfig,
    LinearConfig,
    MultiStepConfig,
    OneCycleConfig,
    PolynomialConfig,
    StepConfig,
    WarmupCosineConfig,
    WSDConfig,
)
from jaxloop.parity.flaxside import FlaxModel, batch_to_jax, no_dropout, policy
from jaxloop.parity.measures import scaled_diffs, whole_rel_diff, worst
from jaxloop.parity.torchside import batch_to_torch, require_torch, to_numpy
from jaxloop.parity.weights import LAYOUTS, Mapping

# ----------------------------------------------------------------------------- optimizers, one function per side


def jax_optimizer(o: OptimConfig, steps: int, precision: str) -> optax.GradientTransformation:
    """jaxloop's optimizer for an OptimConfig (what a jaxloop run with this config trains with)."""
    from jaxloop.update.optimizer import make_optimizer

    return make_optimizer(o, steps, policy(precision))


def torch_optimizer(o: OptimConfig, steps: int, module: Any) -> tuple[Any, Any, Callable[[], Any]]:
    """(optimizer, scheduler, clip) for an OptimConfig: torch's own classes as torch_ref builds them."""
    from torch_ref.optim import clip_gradients, make_optimizer
    from torch_ref.schedule import make_scheduler

    cfg = Config(optim=o, steps=steps)
    optimizer = make_optimizer(cfg, module)
    return (
        optimizer,
        make_scheduler(cfg, optimizer),
        lambda: clip_gradients(module.parameters(), o.clip_norm, mode="optax"),
    )


def update_configs(grad_norm: float) -> list[tuple[str, OptimConfig, int]]:
    """(label, OptimConfig, schedule length) of the update check: the default AdamW with warmup-cosine and
    clipping that acts (clip_norm half the gradient's norm), variants of its hyperparameters, then every
    other optimizer and every schedule jaxloop offers (MENU), each with settings under which it changes
    the rate or the update within the check's few updates. Warmup starts above 0 so that the first
    updates move the params."""
    clip = float(f"{0.5 * grad_norm:.3g}") if grad_norm > 0 else 1.0
    base = OptimConfig(
        optimizer=AdamWConfig(weight_decay=1e-4),
        lr_schedule=WarmupCosineConfig(init_lr=1e-3, end_lr=3e-5, warmup_steps=2),
        peak_lr=3e-3,
        clip_norm=clip,
    )
    return [
        (f"adamw, warmup-cosine, clip {clip:g}", base, 10),
        (
            "adamw, no clip, weight decay 0.1, b2 0.95, eps 1e-6",
            replace(base, clip_norm=0.0, optimizer=AdamWConfig(weight_decay=0.1, b2=0.95, eps=1e-6)),
            10,
        ),
        (
            "adamw, constant rate 1e-2, b1 0.5",
            replace(
                base,
                peak_lr=1e-2,
                optimizer=AdamWConfig(weight_decay=1e-4, b1=0.5),
                lr_schedule=WarmupCosineConfig(init_lr=1e-2, end_lr=1e-2, warmup_steps=0),
            ),
            10,
        ),
        *((label, OptimConfig(clip_norm=clip, **changes), 10) for label, changes in MENU),
    ]


# Every optimizer beside adamw, and every schedule beside warmup_cosine but plateau (its rate changes only
# at an evaluation: parity_tests/test_schedules.py holds it to ReduceLROnPlateau), without warmup so that
# each schedule acts from the first update (one_cycle has none); the clipping that acts, as in base, and
# every field the entry does not name at its default (a field its optimizer or schedule does not read
# must be: jaxloop.config.run.validate).
MENU: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "adam, step (step_size 1, gamma 0.5)",
        dict(optimizer=AdamConfig(), lr_schedule=StepConfig(warmup_steps=0, step_size=1, gamma=0.5)),
    ),
    (
        "sgd, nesterov momentum 0.9, multistep (1, 2)",
        dict(
            optimizer=SGDConfig(momentum=0.9, nesterov=True),
            lr_schedule=MultiStepConfig(warmup_steps=0, milestones=(1, 2), gamma=0.5),
            peak_lr=1e-2,
        ),
    ),
    (
        "sgd, momentum 0.9 dampening 0.1, exponential 0.8",
        dict(
            optimizer=SGDConfig(momentum=0.9, dampening=0.1),
            lr_schedule=ExponentialConfig(warmup_steps=0, gamma=0.8),
            peak_lr=1e-2,
        ),
    ),
    ("sgd, constant", dict(optimizer=SGDConfig(), lr_schedule=ConstantConfig(warmup_steps=0), peak_lr=1e-2)),
    (
        "rmsprop, centered momentum 0.9, cosine restarts (t_0 2)",
        dict(
            optimizer=RMSpropConfig(centered=True, momentum=0.9),
            lr_schedule=CosineRestartsConfig(warmup_steps=0, t_0=2),
        ),
    ),
    ("rmsprop, linear", dict(optimizer=RMSpropConfig(), lr_schedule=LinearConfig(warmup_steps=0, end_lr=1e-4))),
    (
        "adagrad, lr_decay 0.01, accumulator 0.1, one-cycle",
        dict(
            optimizer=AdagradConfig(lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-10),
            lr_schedule=OneCycleConfig(),
            peak_lr=1e-2,
        ),
    ),
    (
        "lion, wsd (decay 8, 1-sqrt)",
        dict(
            optimizer=LionConfig(b2=0.99),
            lr_schedule=WSDConfig(warmup_steps=0, end_lr=1e-5, decay_steps=8, decay_type="1-sqrt"),
            peak_lr=1e-4,
        ),
    ),
    (
        "adam, polynomial (power 2)",
        dict(optimizer=AdamConfig(), lr_schedule=PolynomialConfig(warmup_steps=0, power=2.0)),
    ),
    ("adamw, inverse sqrt (timescale 1)", dict(lr_schedule=InverseSqrtConfig(warmup_steps=0, timescale=1))),
)


def trajectory_config(grad_norm: float) -> OptimConfig:
    """The trajectory's optimizer: the first update config (the default AdamW with warmup-cosine)."""
    return update_configs(grad_norm)[0][1]


# ----------------------------------------------------------------------------- gradients


def torch_param_grads(
    module: Any, loss: Callable, batch: dict[str, Any], precision: str
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {state_dict key: gradient}) of one train-mode backward pass."""
    module.train()
    module.zero_grad(set_to_none=True)
    value = loss(module, batch_to_torch(batch, precision))
    value.backward()
    grads = {
        k: (to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape))) for k, p in module.named_parameters()
    }
    module.zero_grad(set_to_none=True)
    return float(value.detach()), grads


def to_flax_params(mapping: Mapping, torch_values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{flax param leaf: value} of per-parameter torch values (gradients, params) through the mapping."""
    out = {}
    for e in mapping.entries:
        if e.kind == "param":
            key = e.torch if e.torch in torch_values else mapping.tied.get(e.torch, e.torch)
            out[e.flax] = LAYOUTS[e.layout][0](torch_values[key])
    return out


def flax_param_grads(
    fm: FlaxModel, loss: Callable, batch: dict[str, Any], precision: str
) -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {flax param leaf: gradient}) of one train-mode backward pass (jaxloop.model.interface's bind, dropout off)."""
    jbatch = batch_to_jax(batch, precision)
    fn = no_dropout(loss)

    def value(params: Any) -> Any:
        model, _ = fm.adapter.bind(params, fm.model_state, True, jax.random.PRNGKey(0), policy(precision))
        return fn(model, jbatch, True)[0]

    v, g = jax.jit(jax.value_and_grad(value))(fm.params)
    kinds = fm.kinds()
    leaves = replace(fm, params=g).leaves()
    return float(v), {k: np.asarray(a) for k, a in leaves.items() if kinds[k] == "param"}


# ----------------------------------------------------------------------------- updates


def varied(grads: dict[str, np.ndarray], u: int) -> dict[str, np.ndarray]:
    """The gradients of update u: update 0's as given; later ones multiplied elementwise by factors drawn
    from [-0.5, 1.5) (seeded by u), so that direction and size change from update to update."""
    if u == 0:
        return grads
    rng = np.random.default_rng(u)
    return {k: (g * rng.uniform(-0.5, 1.5, np.shape(g))).astype(np.asarray(g).dtype) for k, g in sorted(grads.items())}


@dataclass
class UpdateResult:
    label: str
    diff: float  # max over updates and tensors of the relative difference of the params
    where: str
    clipping: str  # "acting" (torch's pre-clip norm reached clip_norm at some update), "idle", "" (no clipping)


def updates(
    torch_module: Any,
    fm: FlaxModel,
    mapping: Mapping,
    grads: dict[str, np.ndarray],
    precision: str,
    configs: list[tuple[str, OptimConfig, int]],
    n: int = 3,
) -> list[UpdateResult]:
    """`n` updates of each config's optimizer on both sides, from the same params with the same gradients
    (`varied` from update to update). jaxloop's side: one jitted update per config, on the params
    grouped as `Groups` holds them (each leaf's elements as they are, its weight decay as it is)."""
    torch = require_torch()
    kinds = fm.kinds()
    leaves = fm.leaves()
    groups = Groups(fm.params)
    per_update = [varied(grads, u) for u in range(n)]
    jax_grads = [groups.pack(replace(fm, params=fm.params).with_leaves(g, precision).params) for g in per_update]
    torch_grads = [mapping.to_torch({**leaves, **g}) for g in per_update]
    txs = [jax_optimizer(o, steps, precision) for _, o, steps in configs]

    # one jitted update per config: on the grouped params one program of all thirteen made the example GPT-2's
    # whole check no shorter (18.3 s against 18.4 s), and a config's failure stays its own
    jitted = [jax.jit(lambda g, state, p, tx=tx: tx.update(g, state, p)) for tx in txs]

    def step_all(g: Any, states: list, params: list) -> tuple[list, list]:
        out = [fn(g, state, p) for fn, state, p in zip(jitted, states, params)]
        return [apply_updates(p, u) for p, (u, _) in zip(params, out)], [state for _, state in out]

    params = [groups.params] * len(configs)
    states = [tx.init(groups.params) for tx in txs]
    torch_sides = []
    for _, o, steps in configs:
        module = _copy(torch_module)
        torch_sides.append((module, *torch_optimizer(o, steps, module)))
    results = [UpdateResult(label, 0.0, "", "idle" if o.clip_norm > 0 else "") for label, o, _ in configs]
    for step in range(n):
        params, states = step_all(jax_grads[step], states, params)
        for i, ((_, o, _), (module, optimizer, scheduler, clip)) in enumerate(zip(configs, torch_sides)):
            named = dict(module.named_parameters())
            for k, p in named.items():
                p.grad = torch.from_numpy(np.array(torch_grads[step][k])).to(p.dtype)
            if float(clip()) >= o.clip_norm > 0:
                results[i].clipping = "acting"
            optimizer.step()
            step_per_update(scheduler)
            own = replace(fm, params=groups.unpack(params[i])).leaves()
            jax_params = {k: v for k, v in own.items() if kinds[k] == "param"}
            torch_params = to_flax_params(mapping, {k: to_numpy(p) for k, p in named.items()})
            d, w = worst(scaled_diffs(jax_params, torch_params))
            if not d <= results[i].diff:
                results[i].diff, results[i].where = d, w
    return results


class Groups:
    """A param tree's leaves joined into one array per (weight decay, dtype): what the update check's
    optimizers run on. Every optimizer jaxloop offers is elementwise but for the clipping's global norm,
    so each element's update is the one it gets in its own leaf (the norm sums the same squares in
    another order: a few ulps), and decay_mask gives each group its leaves' answer (a decayed group is a
    matrix, the other a vector). XLA:CPU's compile time grows with the leaves a program holds: the
    example GPT-2's 28 leaves in 2 groups compile its 13 update programs several times faster
    (docs/porting.md)."""

    def __init__(self, params: Any) -> None:
        from jaxloop.update.transforms import decay_mask

        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [np.shape(x) for x in leaves]
        self.members: dict[str, list[int]] = {}  # group -> its leaves' indices, in the tree's order
        self.decayed: dict[str, bool] = {}
        for i, (x, decay) in enumerate(zip(leaves, jax.tree.leaves(decay_mask(params)))):
            key = f"{'decay' if decay else 'no_decay'}_{np.dtype(x.dtype).name}"
            self.members.setdefault(key, []).append(i)
            self.decayed[key] = bool(decay)
        self.bounds = {  # where each leaf ends in its group's array (np.split's indices)
            key: np.cumsum([int(np.prod(self.shapes[i])) for i in members])[:-1]
            for key, members in self.members.items()
        }
        self.params = self.pack(params)
        if decay_mask(self.params) != self.decayed:  # decay_mask's rule is no longer a leaf's ndim
            raise AssertionError(
                f"decay_mask on the grouped params gives {decay_mask(self.params)}, not {self.decayed}"
            )

    def pack(self, tree: Any) -> dict[str, jax.Array]:
        """tree's leaves joined per group: a decayed group a (1, n) matrix, the other an (n,) vector."""
        # joined on the host and moved once: jnp.concatenate would compile a program per set of shapes
        leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
        out = {}
        for key, members in self.members.items():
            flat = np.concatenate([leaves[i].reshape(-1) for i in members])
            out[key] = jax.device_put(flat[None, :] if self.decayed[key] else flat)
        return out

    def unpack(self, grouped: dict[str, Any]) -> Any:
        """The param tree of grouped arrays (pack's inverse, on the host)."""
        leaves: list[Any] = [None] * len(self.shapes)
        for key, members in self.members.items():
            for i, part in zip(members, np.split(np.asarray(grouped[key]).reshape(-1), self.bounds[key])):
                leaves[i] = part.reshape(self.shapes[i])
        return jax.tree.unflatten(self.treedef, leaves)


apply_updates = jax.jit(optax.apply_updates)


def step_per_update(scheduler: Any) -> None:
    """torch_ref's scheduler step after an update (torch imported only when the check runs)."""
    from torch_ref.schedule import step_per_update as step

    step(scheduler)


def _copy(module: Any) -> Any:
    import copy

    return copy.deepcopy(module)


# ----------------------------------------------------------------------------- trajectory


@dataclass
class Trajectory:
    torch_losses: np.ndarray
    flax_losses: np.ndarray
    param_diffs: np.ndarray  # per update: max over tensors (measures.scaled_diffs)
    whole_diffs: np.ndarray  # per update: the params as one vector (measures.whole_rel_diff)
    worst_tensor: str
    buffer_diff: float | None  # after the last update, max over buffers (None: no buffers)
    torch_params: dict[str, np.ndarray]
    flax_params: dict[str, np.ndarray]


def batch_at(batches: Callable[[int], dict] | Sequence[dict] | None, example: dict, u: int) -> dict:
    if batches is None:
        return example
    if callable(batches):
        return batches(u)
    return batches[u % len(batches)]


def trajectory(
    torch_module: Any,
    fm: FlaxModel,
    mapping: Mapping,
    torch_loss: Callable,
    flax_loss: Callable,
    batches: Any,
    example: dict,
    o: OptimConfig,
    n: int,
    precision: str,
    done: Callable[[int], None] = lambda u: None,
) -> Trajectory:
    """`n` updates through jaxloop.make_train_step and through a plain torch loop, from the same weights;
    `done(u)` after every tenth of them (the command's progress)."""
    from jaxloop.update.state import TrainState
    from jaxloop.update.step import make_train_step

    if n < 1:
        raise ValueError(f"trajectory needs n >= 1 updates (it reports the params after the last), got {n}")

    state = TrainState.create(
        params=fm.params,
        tx=jax_optimizer(o, n, precision),
        rng=jax.random.PRNGKey(0),
        model=fm.adapter,
        model_state=fm.model_state,
        policy=policy(precision),
    )
    step = jax.jit(make_train_step(no_dropout(flax_loss)))
    module = _copy(torch_module)
    optimizer, scheduler, clip = torch_optimizer(o, n, module)
    kinds = fm.kinds()
    t_losses, f_losses, diffs, whole = [], [], [], []
    worst_tensor, worst_value = "", -1.0
    leaves: dict[str, np.ndarray] = {}  # the last update's leaves and params, set by the loop (n >= 1)
    jp: dict[str, np.ndarray] = {}
    tp: dict[str, np.ndarray] = {}
    for u in range(n):
        b = batch_at(batches, example, u)
        state, metrics = step(state, batch_to_jax(b, precision))
        f_losses.append(float(metrics["loss"]))
        module.train()
        optimizer.zero_grad(set_to_none=True)
        loss = torch_loss(module, batch_to_torch(b, precision))
        loss.backward()
        clip()
        optimizer.step()
        step_per_update(scheduler)
        t_losses.append(float(loss.detach()))
        leaves = replace(fm, params=state.params, model_state=state.model_state).leaves()
        jp = {k: v for k, v in leaves.items() if kinds[k] == "param"}
        tp = to_flax_params(mapping, {k: to_numpy(p) for k, p in module.named_parameters()})
        d, w = worst(scaled_diffs(jp, tp))
        diffs.append(d)
        whole.append(whole_rel_diff(jp, tp))
        if not d <= worst_value:
            worst_value, worst_tensor = d, w
        if (u + 1) % max(1, n // 10) == 0 and u + 1 < n:
            done(u + 1)
    buffers = {k: v for k, v in leaves.items() if kinds[k] == "buffer"}
    buffer_diff = None
    if buffers:
        tb = mapping.to_flax({k: to_numpy(v) for k, v in module.state_dict().items()})
        buffer_diff = worst(scaled_diffs(buffers, {k: tb[k] for k in buffers}))[0]
    return Trajectory(
        np.asarray(t_losses),
        np.asarray(f_losses),
        np.asarray(diffs),
        np.asarray(whole),
        worst_tensor,
        buffer_diff,
        tp,
        jp,
    )
