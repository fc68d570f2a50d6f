"""What a run trains: a Task bundles the model, the loss, the optional eval metrics and the records.

    task = jaxloop.Task(model=MyLinenOrNnxModule(...), loss=my_loss, train=train_records, val=val_records)
    jaxloop.run(cfg, task)

`loss(model, batch, train) -> (scalar loss, {name: scalar})`: `model` is the module bound to the params
being trained (see jaxloop.model.interface); batches are dicts of arrays stacked from the records. The aux
metrics are logged as val_<name> after each evaluation. Validation batches carry `weight` (1 for a
record, 0 for the padding that fills the last batch): a loss that weights its mean by it (as
`cross_entropy_loss` does) evaluates exactly; the loop averages batches by their total weight.
The presets (digits, shakespeare, debug) are built-in tasks: `builtin_task(cfg)`.

`optimizer`: the task's own optax optimizer in place of optim.name's: a GradientTransformation (e.g.
optax.adafactor(1e-3)), or a factory called with jaxloop's schedule (count -> rate, optim.schedule's) that
returns one (e.g. `lambda lr: optax.inject_hyperparams(optax.adafactor, static_args="min_dim_size_to_factor")(
learning_rate=lr)`). The loop wraps
its clipping, accumulation, non-finite skip and loss scale around it, checkpoints its state and logs its
rate where optax.inject_hyperparams keeps one `learning_rate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optax

from jaxloop.config.run import Config, ConfigError, builtin_task_fields, preset
from jaxloop.config.schedules import WARMUP_FIELDS
from jaxloop.data.sources import RecordError, SequenceRecords, Splits, as_records, load_splits
from jaxloop.model.builtin import make_model
from jaxloop.model.interface import LossFn
from jaxloop.model.precision import get_policy
from jaxloop.update.optimizer import make_optimizer
from jaxloop.update.state import TrainState, init_state
from jaxloop.update.step import cross_entropy_loss


@dataclass(frozen=True, eq=False)
class Task:
    """A model (flax.linen.Module or flax.nnx.Module), its loss, and training and validation records.

    train / val: any random-access source of records: a sequence of dicts of numpy arrays, a grain
    MapDataset, or jaxloop.data.sources.Records. eval_metrics(model, batch) -> {name: scalar}, if given,
    adds metrics to the validation loss (weighted by batch["weight"] like the loss).
    """

    model: Any
    loss: LossFn
    train: Any
    val: Any
    eval_metrics: Callable[[Callable[..., Any], dict[str, Any]], dict[str, Any]] | None = None
    vocab: tuple[str, ...] | None = None  # written to run_dir/vocab.json for sampling (text tasks)
    optimizer: Any = None  # an optax GradientTransformation or schedule -> GradientTransformation (module doc)

    def splits(self) -> Splits:
        """The records as the data layer reads them."""
        if isinstance(self.train, Splits):
            return self.train
        train, val = as_records(self.train, "train"), as_records(self.val, "val")  # RecordError: split, index, key
        example = train.get(np.zeros(1, np.int64))
        if (
            isinstance(train, SequenceRecords)
            and isinstance(val, SequenceRecords)
            and ([k for k, _, _ in train.spec] != [k for k, _, _ in val.spec])
        ):
            raise RecordError(
                f"record 0 of the val split has keys {[k for k, _, _ in val.spec]}, expected "
                f"{[k for k, _, _ in train.spec]} (as the train split's records have)"
            )
        return Splits(source="task", train=train, val=val, num_classes=0, example_x=example.get("x"), vocab=self.vocab)

    def eval_loss(self) -> LossFn:
        """The loss evaluation runs: the task's loss with eval_metrics' values added to its aux."""
        metrics = self.eval_metrics
        if metrics is None:
            return self.loss

        def loss(model: Callable[..., Any], batch: dict[str, Any], train: bool) -> tuple[Any, dict]:
            value, aux = self.loss(model, batch, train)
            return value, {**aux, **metrics(model, batch)}

        return loss


def builtin_task(cfg: Config, splits: Splits | None = None) -> Task:
    """The task of a preset / CLI run: the config's model (MLP or GPT) and source, cross-entropy."""
    splits = splits if splits is not None else load_splits(cfg)
    return Task(
        model=make_model(cfg.model, splits.num_classes, cfg.precision),
        loss=cross_entropy_loss,
        train=splits,
        val=splits,
    )


def check_builtin_fields(cfg: Config) -> None:
    """A run of a Task of one's own: every field only the built-in tasks read (model.*, data.source, data.path,
    data.val_fraction: jaxloop.config.run.builtin_task_fields) keeps its preset's value, since the Task's model and
    records replace them; a ConfigError names the first that does not, rather than the run ignoring it."""
    base = preset(cfg.preset)
    for name in builtin_task_fields():
        value, default = _dotted(cfg, name), _dotted(base, name)
        if value != default:
            raise ConfigError(
                name,
                value,
                f"the {cfg.preset} preset's {default!r}: only the built-in tasks read it, "
                f"and this run trains a Task of its own (its model and records); leave "
                f"Config.{name.split('.')[0]}'s {name.split('.')[1]} out",
            )


def _dotted(cfg: Any, name: str) -> Any:
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def run_state(cfg: Config, task: Task, splits: Splits | None = None) -> TrainState:
    """The fresh state of a run of cfg on task: init_state with the config's seed, optimizer (or the
    task's own, wrapped in the config's clipping and accumulation), precision and EMA, initialised on
    the task's first training record."""
    splits = splits if splits is not None else task.splits()
    policy = get_policy(cfg.precision)
    return init_state(
        task.model,
        task.loss,
        splits.train.get(np.zeros(1, np.int64)),
        make_optimizer(cfg.optim, cfg.steps, policy, task.optimizer),
        seed=cfg.seed,
        precision=policy,
        ema_decay=cfg.optim.ema_decay,
    )


def check_own_optimizer(cfg: Config, task: Task) -> None:
    """A Task that brings its own optimizer: the config's optimizer fields (and, for a GradientTransformation,
    which has its own rate, the schedule's but the warmup's init_lr, warmup_steps and end_lr, which
    validate() checks against steps for every run) must keep their defaults, and plateau is refused (the
    loop can set only jaxloop's own optimizers' rate): a ConfigError names the field otherwise."""
    if task.optimizer is None:
        return
    o, base = cfg.optim, preset(cfg.preset).optim
    factory = not isinstance(task.optimizer, optax.GradientTransformation)
    if o.schedule == "plateau":
        raise ConfigError(
            "optim.schedule",
            o.schedule,
            "a per-update schedule when the Task brings its own optimizer "
            "(plateau sets the rate of jaxloop's own optimizers only)",
        )
    # the optimizer's fields; for a GradientTransformation also the schedule's and peak_lr (but the warmup's
    # and end_lr, which validate() checks against steps for any run)
    kind = "factory (it reads only the schedule)" if factory else "GradientTransformation (it has its own rate)"
    held = [("optim.name", o.name, base.name), *_fields(o.optimizer, base.optimizer)]
    if not factory:
        held += [("optim.schedule", o.schedule, base.schedule), ("optim.peak_lr", o.peak_lr, base.peak_lr)]
        held += [h for h in _fields(o.lr_schedule, base.lr_schedule) if h[0].split(".")[-1] not in WARMUP_FIELDS]
    for path, value, default in held:
        if value != default:
            raise ConfigError(path, value, f"its default {default!r}: the Task brings its own optimizer, a {kind}")


def _fields(mine: Any, preset_part: Any) -> list[tuple[str, Any, Any]]:
    """(flag, value, the preset's value) of each field of a chosen class (none when the preset chose another)."""
    if type(mine) is not type(preset_part):
        return []
    return [(mine.flag(k), getattr(mine, k), getattr(preset_part, k)) for k in mine.field_names() if k != "end_lr"]


def create_train_state(cfg: Config, model: Any, example_x: Any) -> TrainState:
    """run_state for a built-in model (cross-entropy over {x, y}) without its records: for inputs shaped
    like example_x (labels of zeros make up the rest of the one example record the init reads)."""
    example = {
        "x": np.asarray(example_x),
        "y": np.zeros(
            np.shape(example_x)[:1]
            + (
                (np.shape(example_x)[1],)
                if np.ndim(example_x) == 2 and np.issubdtype(np.asarray(example_x).dtype, np.integer)
                else ()
            ),
            np.int32,
        ),
    }
    records = [{k: v[0] for k, v in example.items()}]
    return run_state(cfg, Task(model=model, loss=cross_entropy_loss, train=records, val=records))
