"""The run configuration: one tree of frozen dataclasses, presets, and validation.

Imports no jax and no torch: jaxloop, torch_ref and the CLI all read this module. A Config is
validated once, at the edge (`validate`), and saved with every run (`to_dict` / `from_dict`).

Each field declares, in its `metadata`, whether a resumed run may change it (TRAJECTORY: no; PLAN, HOST: yes)
and whether only the built-in tasks read it (BUILTIN_TASK); a section's declaration
(`optim: OptimConfig = field(..., metadata=TRAJECTORY)`) covers every field inside it that declares none, so a
new config class under a section needs no declaration unless a field of it differs. A field no declaration
covers changes the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, get_args, get_type_hints

from jaxloop.config.checks import (
    check_type,
    finite,
    is_int,
    nonneg_float,
    nonneg_int,
    one_of,
    positive_float,
    positive_int,
    readable_file,
    writable_dir,
)
from jaxloop.config.errors import (  # its home is jaxloop.config.errors; still importable from here
    ConfigError,
    short_repr,
)
from jaxloop.config.optimizers import OPTIMIZERS, AdamWConfig, OptimizerConfig
from jaxloop.config.schedules import (  # noqa: F401  (PlateauConfig: importable from here, as before)
    SCHEDULES,
    ConstantConfig,
    PlateauConfig,
    ScheduleConfig,
    WarmupCosineConfig,
)
from jaxloop.rundir.layout import TORCH_CHECKPOINT, RunLayout

PRECISIONS = ("fp32", "bf16", "bf16_full", "fp16", "fp64", "auto")
REMATS = ("none", "blocks", "dots_saveable", "full")
PRESETS = ("digits", "shakespeare", "debug", "gpt2-small", "gpt2-finetune")
ATTENTIONS = ("auto", "xla", "cudnn")


@dataclass(frozen=True)
class Rule:
    """What a change of a field between runs does. `resume_safe`: a resumed run may change it (the trajectory
    stays the same)."""

    resume_safe: bool


RULE_KEY = "jaxloop.rule"
# The rules, as the `metadata` of a field's declaration: `seed: int = field(default=0, metadata=TRAJECTORY)`.
# A section's field (`memory: MemoryConfig = field(..., metadata=PLAN)`) gives its rule to every field inside
# it that declares none of its own; a field no declaration covers changes the run (the safe choice).
# RESUME_SAFE (the bottom of this module) is derived from these declarations, and tests/test_config_rules.py
# holds its expected contents: a new field is classified here, once.
TRAJECTORY = {RULE_KEY: Rule(resume_safe=False)}
"""Changes the trajectory (what is computed, from which initial values and data order, on which evaluation
batches): a resume may not change it (the default)."""
PLAN = {RULE_KEY: Rule(resume_safe=True)}
"""Changes how the update is computed, not what: other compiled code, the same math (jaxloop.update.memory_plan);
a resume may change it."""
HOST = {RULE_KEY: Rule(resume_safe=True)}
"""The host's business (where and how often to write, log, evaluate, wait; how XLA:GPU picks kernels, not what
they compute: deterministic; how the calls' arguments are laid out: data.eval_batch_size, distributed.*,
updates_per_call): neither the math nor its inputs, so a resume may change it."""

BUILTIN_TASK_KEY = "jaxloop.builtin_task"
BUILTIN_TASK = {BUILTIN_TASK_KEY: True}
"""Read only by the built-in tasks (the presets' models and data sources), beside a field's rule
(`metadata={**TRAJECTORY, **BUILTIN_TASK}`) or alone (its section's rule then): a run of a Task of one's own
refuses such a field set away from its preset's value (jaxloop.loop.task.check_builtin_fields); a field not so
declared is read by every run."""


@dataclass(frozen=True)
class OptimShared:
    """What every optimizer and schedule reads: the rate, clipping, accumulation and EMA."""

    peak_lr: float = 3e-3
    """Learning rate at the end of warmup."""
    clip_norm: float = 1.0
    """Clip the mean accumulated gradient to this global L2 norm (0 = no clipping)."""
    accum_steps: int = 1
    """Micro-batches accumulated per update (optax.MultiSteps K); one update per K micro-batches."""
    ema_decay: float = 0.0
    """Exponential moving average of params, updated each update (0 = off)."""


@dataclass(frozen=True)
class OptimConfig(OptimShared):
    """The optimizer and its learning-rate schedule (torch's semantics and names; docs/optimizers.md),
    global-norm clipping and gradient accumulation: `OptimConfig(optimizer=SGDConfig(momentum=0.9),
    lr_schedule=StepConfig(step_size=100), peak_lr=0.1)`, each class with its own defaults. config.json, the
    checkpoints' config item and config files hold this nesting (`to_dict`); Python takes only it (a field
    of a class is set on that class: `replace(o, lr_schedule=replace(o.lr_schedule, warmup_steps=10))`)."""

    optimizer: OptimizerConfig = field(default_factory=AdamWConfig)
    """optim.name's config: AdamWConfig (default), AdamConfig, SGDConfig, RMSpropConfig, AdagradConfig, LionConfig."""
    lr_schedule: ScheduleConfig = field(default_factory=WarmupCosineConfig)
    """optim.schedule's config: WarmupCosineConfig (default), ConstantConfig, ..., PlateauConfig (SCHEDULES)."""

    @property
    def name(self) -> str:
        """optim.name: the chosen optimizer class's name (OPTIMIZERS)."""
        return self.optimizer.name

    @property
    def schedule(self) -> str:
        """optim.schedule: the chosen schedule class's name (SCHEDULES)."""
        return self.lr_schedule.name

    def validate(self, steps: int) -> None:
        """ConfigError for the first field that is not allowed (optim.*): the shared fields, then the chosen
        optimizer's and schedule's own (their classes' validate; a schedule's spans read `steps`)."""
        positive_float("optim.peak_lr", self.peak_lr)
        nonneg_float("optim.clip_norm", self.clip_norm)
        positive_int("optim.accum_steps", self.accum_steps)
        finite("optim.ema_decay", self.ema_decay)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError("optim.ema_decay", self.ema_decay, "a number in [0, 1) (0 = off)")
        if type(self.optimizer) not in OPTIMIZERS.values():
            raise ConfigError(
                "optim.optimizer", self.optimizer, f"one of {', '.join(c.__name__ for c in OPTIMIZERS.values())}"
            )
        if type(self.lr_schedule) not in SCHEDULES.values():
            raise ConfigError(
                "optim.lr_schedule", self.lr_schedule, f"one of {', '.join(c.__name__ for c in SCHEDULES.values())}"
            )
        self.optimizer.validate()
        self.lr_schedule.validate(self.peak_lr, steps)


# ----------------------------------------------------------------------------- the flat form (flags, older files)
# What stays of the flat form, for what users already write: the flags (--optim.b1, --optim.name adagrad,
# --optim.plateau.patience 3), a --config file's flat optim keys, and the config.json / checkpoint config items
# jaxloop wrote before the nested form (all 33 fields flat under optim.). `rewrite_flat` puts flat keys onto
# the chosen classes; from_dict reads an older flat section through it. Nothing jaxloop writes is flat, OptimConfig
# takes no flat keyword, and the nested flags (--optim.optimizer.b1) are read as flat ones (config.optim_flags).

SECTIONS = ("optimizer", "lr_schedule")
"""The nested keys of the optim section: the chosen classes, each a mapping with its `name`."""


def flat_hints() -> dict[str, Any]:
    """Every flat key's type (the flags' optim.*): name and schedule, every class's fields (plateau's as one
    key, its class), the shared fields."""
    out: dict[str, Any] = {"name": Literal[tuple(OPTIMIZERS)], "schedule": Literal[tuple(SCHEDULES)]}
    for cls in [*OPTIMIZERS.values(), *SCHEDULES.values()]:
        hints = get_type_hints(cls)
        out.update({cls.prefix.rstrip("."): cls} if cls.prefix else {k: hints[k] for k in cls.field_names()})
    return {**out, **get_type_hints(OptimShared)}


def readers(key: str) -> list[str]:
    """The choices that read flat key `key` (optim.name=sgd, optim.schedule=step), from the classes."""
    return [
        f"optim.{cls.selector}={cls.name}"
        for cls in [*OPTIMIZERS.values(), *SCHEDULES.values()]
        if key == cls.prefix.rstrip(".") or (not cls.prefix and key in cls.field_names())
    ]


def rewrite_flat(o: OptimConfig, changes: dict[str, Any], path: str = "optim.", stored: bool = False) -> OptimConfig:
    """o with flat keys applied: `name` and `schedule` pick a class (o's own instance if it is that class, else
    the class with its own defaults: `switched`), every other key sets a field of o or of a chosen class (`plateau`: a
    mapping of, or a, PlateauConfig). A key the chosen classes do not read: ConfigError naming who reads it;
    `stored` (an older config.json, which wrote every class's fields flat): dropped."""
    hints = flat_hints()
    for key in changes:
        if key not in hints:
            raise ConfigError(f"{path}{key}", changes[key], f"a known field{_did_you_mean(key, set(hints), path)}")
    new = {k: _coerce(f"{path}{k}", v, hints[k]) if not is_dataclass(hints[k]) else v for k, v in changes.items()}
    opt_cls = _one_of(f"{path}name", new.pop("name", o.name), OPTIMIZERS)
    sched_cls = _one_of(f"{path}schedule", new.pop("schedule", o.schedule), SCHEDULES)
    parts = {}
    for part, cls in ((o.optimizer, opt_cls), (o.lr_schedule, sched_cls)):
        part = switched(part, cls)
        key = cls.prefix.rstrip(".")
        if key in new:
            value = new.pop(key)
            value = value if isinstance(value, dict) else dataclasses.asdict(value)
            part = from_dict(value, part, cls, f"{path}{key}.")
        own = {k: new.pop(k) for k in list(new) if not cls.prefix and k in cls.field_names()}
        parts[cls.selector] = replace(part, **own)
    shared = {k: new.pop(k) for k in list(new) if k in get_type_hints(OptimShared)}
    if new and not stored:  # a key the chosen classes do not read
        key, value = next(iter(new.items()))
        who = next(f"optim.{c.selector}={c.name}" for c in (opt_cls, sched_cls) if c.selector in readers(key)[0])
        raise ConfigError(f"{path}{key}", value, f"absent ({who} does not read it; read by {', '.join(readers(key))})")
    return replace(o, optimizer=parts["name"], lr_schedule=parts["schedule"], **shared)


def switched(part: Any, cls: type) -> Any:
    """`part` (an optimizer's or a schedule's config) as class `cls`: itself if it is one, else `cls` with its own
    defaults but for the fields of the nearest class both derive from, which mean the same in both (every
    optimizer's weight_decay; every warmup schedule's init_lr and warmup_steps; adam's b1, b2, eps from adamw)."""
    if type(part) is cls:
        return part
    common = next(c for c in type(part).__mro__ if issubclass(cls, c))
    return cls(**{f.name: getattr(part, f.name) for f in fields(common)})


def _one_of(path: str, value: Any, menu: dict[str, Any]) -> Any:
    if value not in menu:
        raise ConfigError(path, value, f"one of {', '.join(menu)}")
    return menu[value]


@dataclass(frozen=True)
class ModelConfig:
    """The built-in models: an MLP (digits, .npz) and a character-level GPT (text)."""

    kind: Literal["mlp", "gpt"] = "mlp"
    """Which model: mlp (classification of feature vectors) or gpt (next-character prediction)."""
    hidden: tuple[int, ...] = (128, 128)
    """MLP hidden layer widths."""
    activation: Literal["gelu", "relu", "tanh"] = "gelu"
    """MLP activation (gelu is the tanh approximation, in both jaxloop and torch_ref)."""
    context: int = 64
    """GPT context length in characters."""
    d_model: int = 128
    """GPT embedding width."""
    n_layers: int = 4
    """GPT transformer blocks."""
    n_heads: int = 4
    """GPT attention heads (must divide d_model)."""
    mlp_ratio: int = 4
    """GPT MLP hidden width as a multiple of d_model."""
    dropout: float = 0.0
    """GPT dropout rate on attention weights and residual branches (0 = off)."""
    tie_embeddings: bool = True
    """GPT output head shares the token embedding matrix."""
    vocab_size: int = 0
    """Output classes / vocabulary size; 0 = taken from the data."""
    vocab_multiple: int = 1
    """GPT: the vocabulary (vocab_size or the data's) rounded up to a multiple of this, for faster matmuls
    (GPT-2's 50257 -> 50304 with 64, as nanoGPT and llm.c); the extra tokens never occur in the data."""
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    """GPT attention: xla (written out, compiled by XLA), cudnn (jax.nn.dot_product_attention's cuDNN fused
    kernel: an NVIDIA GPU, bf16/fp16, head dim a multiple of 8), auto (cudnn where it runs, else xla;
    metadata.json records the choice). docs/language-models.md."""
    init: Literal["normal", "gpt2"] = "normal"
    """GPT initialisation: normal (matrices and embeddings normal(0.02), biases 0), gpt2 (as normal, with the
    residual projections attn.proj and mlp_proj at 0.02 / sqrt(2 * n_layers), GPT-2's)."""
    gelu: Literal["tanh", "exact"] = "tanh"
    """GPT MLP activation: GELU's tanh approximation (GPT-2's gelu_new) or its exact erf form (transformers'
    gelu); --init_from a Hugging Face GPT-2 sets it from the checkpoint's config."""
    ln_eps: float = 1e-5
    """GPT LayerNorm epsilon (GPT-2's layer_norm_epsilon; torch's default)."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (model.*)."""
        one_of("model.kind", self.kind, ("mlp", "gpt"))
        one_of("model.activation", self.activation, ("gelu", "relu", "tanh"))
        if not self.hidden or not all(is_int(h) and h > 0 for h in self.hidden):
            raise ConfigError("model.hidden", self.hidden, "one or more positive integers")
        for name in ("context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            positive_int(f"model.{name}", getattr(self, name))
        if self.d_model % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"a divisor of model.d_model ({self.d_model})")
        finite("model.dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("model.dropout", self.dropout, "a number in [0, 1)")
        nonneg_int("model.vocab_size", self.vocab_size)
        positive_int("model.vocab_multiple", self.vocab_multiple)
        for name in (
            "context",
            "d_model",
            "n_layers",
            "n_heads",
            "mlp_ratio",
            "vocab_size",
            "vocab_multiple",
            "hidden",
        ):
            for v in self.hidden if name == "hidden" else (getattr(self, name),):
                if v > INT32_MAX:
                    raise ConfigError(f"model.{name}", v, f"an integer <= {INT32_MAX} (sizes and token ids are int32)")
        one_of("model.attention", self.attention, ATTENTIONS)
        one_of("model.init", self.init, ("normal", "gpt2"))
        one_of("model.gelu", self.gelu, ("tanh", "exact"))
        finite("model.ln_eps", self.ln_eps)
        if self.ln_eps <= 0:
            raise ConfigError("model.ln_eps", self.ln_eps, "a positive number")


@dataclass(frozen=True)
class DataConfig:
    """Where the records come from and how the loader feeds them."""

    source: Literal["digits", "text", "npz", "tokens"] = field(default="digits", metadata=BUILTIN_TASK)
    """digits (scikit-learn's bundled 8x8 digits), text (a UTF-8 file, characters), npz (x, y arrays), tokens
    (token shards: llm.c's format or nanoGPT's .bin, memory-mapped; docs/data.md)."""
    path: str = field(default="", metadata=BUILTIN_TASK)
    """File for the text or npz source; for tokens one shard, a directory of shards or a glob."""
    val_fraction: float = field(default=0.2, metadata=BUILTIN_TASK)
    """Fraction of records held out for validation (npz: ignored when x_val/y_val exist)."""
    train: str = field(default="", metadata=BUILTIN_TASK)
    """tokens: the training shards (a glob, a directory or a file) when their names do not say it; data.path
    is then empty (docs/data.md#token-shards)."""
    val: str = field(default="", metadata=BUILTIN_TASK)
    """tokens, with data.train: the validation shards (empty: each training file's last val_fraction)."""
    allow_changed: bool = field(default=False, metadata={**HOST, **BUILTIN_TASK})
    """Resume on data that changed since the run last started (refused otherwise: docs/faults.md); this
    launch only."""
    workers: int = field(default=0, metadata=HOST)
    """Loader worker processes (0 = in the main process); batches are the same for every count."""
    prefetch: int = field(default=2, metadata=HOST)
    """Batches put on the device ahead of the step."""
    eval_batch_size: int = field(default=0, metadata=HOST)
    """Validation batch size (0 = batch_size)."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (data.*; whether data.path names a readable
        file is `validate(cfg, check_paths=True)`'s)."""
        one_of("data.source", self.source, ("digits", "text", "npz", "tokens"))
        finite("data.val_fraction", self.val_fraction)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in (0, 1)")
        nonneg_int("data.workers", self.workers)
        cores = usable_cores()
        if self.workers > WORKERS_PER_CORE * cores:
            raise ConfigError(
                "data.workers",
                self.workers,
                f"an integer in [0, {WORKERS_PER_CORE * cores}] "
                f"({WORKERS_PER_CORE} per CPU core this process may use: {cores}; each worker is a "
                "process of its own)",
            )
        nonneg_int("data.prefetch", self.prefetch)
        nonneg_int("data.eval_batch_size", self.eval_batch_size)
        check_type("data.allow_changed", self.allow_changed, bool)
        for name, value in (("data.train", self.train), ("data.val", self.val)):
            if value and self.source != "tokens":
                raise ConfigError(name, value, f"empty unless data.source is tokens (it is {self.source})")
        if self.val and not self.train:
            raise ConfigError("data.val", self.val, "empty unless data.train names the training shards too")
        if self.train and self.path:
            raise ConfigError(
                "data.path",
                self.path,
                f"empty when data.train names the training shards "
                f"({self.train}); put the validation shards in data.val",
            )


WORKERS_PER_CORE = 4
"""data.workers is at most this many per CPU core the process may use: more only wait on each other, and each is
a process with its own memory and semaphores (200 on 2 cores trained nothing in 90 s)."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax rotating checkpoints: last N, best N by a validation metric, every M-th kept."""

    every: int = 100
    """Save every this many updates (and at the end); 0 = only at the end."""
    keep_last: int = 2
    """Keep the newest this many checkpoints."""
    keep_best: int = 1
    """Keep the best this many checkpoints by best_metric (0 = no best tracking)."""
    keep_every: int = 0
    """Keep every checkpoint whose update is a multiple of this, for good (0 = none)."""
    best_metric: str = "val_loss"
    """Validation metric that ranks checkpoints and drives early stopping (val_loss, val_acc, ema_val_*)."""
    best_mode: Literal["min", "max"] = "min"
    """Whether a smaller (min) or larger (max) best_metric is better."""
    async_save: bool = True
    """Write checkpoints in the background; the final save is always awaited."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (checkpoint.*)."""
        nonneg_int("checkpoint.every", self.every)
        positive_int("checkpoint.keep_last", self.keep_last)
        nonneg_int("checkpoint.keep_best", self.keep_best)
        nonneg_int("checkpoint.keep_every", self.keep_every)
        one_of("checkpoint.best_metric", self.best_metric, ("val_loss", "val_acc", "ema_val_loss", "ema_val_acc"))
        one_of("checkpoint.best_mode", self.best_mode, ("min", "max"))


TRACKER_MODULES = {"wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}
"""log.trackers' names and the modules each needs (the extra of its name installs them; MLflow's sqlite store
needs SQLAlchemy and Alembic beside mlflow-skinny)."""


@dataclass(frozen=True)
class LogConfig:
    """Progress, writers, profiling and the run report."""

    progress: Literal["auto", "bar", "plain", "off"] = "auto"
    """Progress bar on a terminal, plain lines otherwise (auto), or forced."""
    tensorboard: bool = True
    """Write TensorBoard event files into run_dir/tb."""
    profile_start: int = 0
    """First update of a jax.profiler trace (with profile_steps > 0)."""
    profile_steps: int = 0
    """Updates captured by the profiler trace into run_dir/profile (0 = off)."""
    breakdown: bool = False
    """At the end, time compiled forward / forward+backward / update variants: the report splits an update's time."""
    price_per_hour: float = 0.0
    """Machine price in $/hour, for the cost line of the report."""
    report: bool = True
    """Write report.md and its PNGs at the end of the run."""
    trackers: tuple[str, ...] = ()
    """Experiment trackers beside metrics.jsonl and TensorBoard (like HF's report_to): wandb (offline run files
    in run_dir/trackers), mlflow (a sqlite store in run_dir/trackers unless log.mlflow_uri); see docs/observing.md."""
    project: str = "jaxloop"
    """The W&B project and the MLflow experiment a run is logged under (its run name: the run_dir's name)."""
    mlflow_uri: str = ""
    """MLflow's tracking URI ("" = sqlite:///<run_dir>/trackers/mlflow.db)."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (log.*)."""
        one_of("log.progress", self.progress, ("auto", "bar", "plain", "off"))
        for name in self.trackers:
            one_of("log.trackers", name, tuple(TRACKER_MODULES))
            missing = [m for m in TRACKER_MODULES[name] if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(
                    "log.trackers",
                    name,
                    f"an installed tracker ({missing[0]} is not installed): pip install 'jaxloop[{name}]'",
                )
        nonneg_int("log.profile_start", self.profile_start)
        nonneg_int("log.profile_steps", self.profile_steps)
        nonneg_float("log.price_per_hour", self.price_per_hour)


@dataclass(frozen=True)
class DistributedConfig:
    """Several processes (hosts) training one model: run the same command in each, with its process_id."""

    num_processes: int = 1
    """Processes taking part (1 = this process alone, over all its devices)."""
    process_id: int = 0
    """This process's index in [0, num_processes); process 0 writes the run's files."""
    coordinator: str = ""
    """host:port of process 0's coordination service (needed when num_processes > 1)."""
    fsdp: int = 1
    """Devices over which the state (params, optimizer state, EMA) is sharded; must divide the device
    count, the other factor is the data-parallel axis (1 = state replicated on every device)."""
    peer_timeout_s: int = 300
    """Seconds a process waits for all num_processes to reach the coordinator before it ends with one line."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (distributed.*)."""
        positive_int("distributed.num_processes", self.num_processes)
        positive_int("distributed.peer_timeout_s", self.peer_timeout_s)
        positive_int("distributed.fsdp", self.fsdp)  # divides the device count: checked when jax starts
        if not is_int(self.process_id) or not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                "distributed.process_id",
                self.process_id,
                f"an integer in [0, distributed.num_processes={self.num_processes})",
            )
        if self.num_processes > 1:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(
                    "distributed.coordinator",
                    self.coordinator,
                    "host:port of process 0 (needed when distributed.num_processes > 1)",
                )


@dataclass(frozen=True)
class MemoryConfig:
    """The memory plan of the update (jaxloop.update.memory_plan): checked against the device before the first update,
    re-planned to fit. Every field keeps the math (a resume may change them) but changes the compiled call."""

    budget: int = 0
    """Bytes the compiled update may use (arguments + outputs + temporaries - donated); 0 = the device's
    limit (memory_stats()['bytes_limit'] on an accelerator; on a CPU the available RAM beside the arguments)."""
    auto_fit: bool = True
    """When the compiled update does not fit: re-plan (memory.split x2 ..., then memory.remat) until it does,
    and after an out-of-memory error at run time reload the last checkpoint and re-plan; off: only warn."""
    split: int = 1
    """Sub-batches each micro-batch is split into inside the step, their gradients averaged: the same records
    per update and, for a loss that is a mean over records, the same update up to rounding. Must divide
    the micro-batch's rows on each device (batch_size / device count)."""
    remat: Literal["none", "blocks", "dots_saveable", "full"] = "none"
    """Rematerialisation (activations recomputed in the backward pass): none; blocks (the model's own blocks
    under nn.remat: the built-in GPT, or a Linen module with a `remat` field; torch_ref's GPT too, which reads
    no other); dots_saveable or full (jax.checkpoint policies around the whole loss: keep only matmul outputs,
    or nothing). The former model.remat=true (a flag, a file, a saved config) is read as blocks."""

    def validate(self) -> None:
        """ConfigError for the first field that is not allowed (memory.*; that split divides batch_size is
        `validate(cfg)`'s)."""
        nonneg_int("memory.budget", self.budget)
        check_type("memory.auto_fit", self.auto_fit, bool)
        positive_int("memory.split", self.split)
        one_of("memory.remat", self.remat, REMATS)


@dataclass(frozen=True)
class Config:
    """A jaxloop run. Flags are the dotted field paths, e.g. --optim.peak_lr 3e-4."""

    preset: str = field(default="digits", metadata=TRAJECTORY)
    """Starting point for every other default: digits, shakespeare, debug, gpt2-small or gpt2-finetune."""
    run_dir: str = field(default="runs/digits", metadata=HOST)
    """Directory for config.json, metrics.jsonl, checkpoints and the report."""
    seed: int = field(default=0, metadata=TRAJECTORY)
    """Seeds initialisation, data order and per-step randomness."""
    steps: int = field(default=500, metadata=TRAJECTORY)
    """Optimizer updates to run (each consumes optim.accum_steps micro-batches)."""
    batch_size: int = field(default=64, metadata=TRAJECTORY)
    """Global micro-batch size (records per micro-batch, over all processes)."""
    eval_every: int = field(default=100, metadata=HOST)
    """Validate over the whole validation split (or eval_batches' subset) every this many updates (0 = only
    at the end)."""
    eval_batches: int = field(default=0, metadata=TRAJECTORY)
    """Evaluate a fixed, seeded subset of this many validation batches (data.eval_batch_size records each), the
    same at every evaluation (nanoGPT's eval_iters, Lightning's limit_val_batches); 0 = the whole split."""
    log_every: int = field(default=10, metadata=HOST)
    """Record metrics every this many updates."""
    updates_per_call: int = field(default=0, metadata=HOST)
    """Most updates the loop dispatches in one device call (one lax.scan); 0 = auto (up to 50). Every call
    ends on the evaluation, checkpoint and end cadences; logs come from the call's per-update metrics. The
    host waits for the device once per call: larger calls cost less, smaller ones answer a signal sooner."""
    precision: Literal["fp32", "bf16", "bf16_full", "fp16", "fp64", "auto"] = field(default="fp32", metadata=TRAJECTORY)
    """fp32; bf16: matmuls in bf16, the rest fp32 (torch.autocast's way); bf16_full: the whole model in bf16;
    fp16: as bf16 with fp16 matmuls and a dynamic loss scale; fp64: float64 throughout (the run turns on JAX's
    64-bit mode for its own length; for parity); auto: bf16 on an accelerator, fp32 on a CPU (the run's config.json
    records the one chosen)."""
    resume: Literal["auto", "never", "must"] = field(default="auto", metadata=HOST)
    """auto: resume from run_dir if it holds a checkpoint; never: start fresh; must: fail without one."""
    allow_steps_change: bool = field(default=False, metadata=HOST)
    """Accept a different `steps` when resuming (the schedule then differs from the original run)."""
    max_bad_steps: int = field(default=20, metadata=HOST)
    """Stop the run after this many consecutive skipped (non-finite) updates."""
    patience: int = field(default=0, metadata=HOST)
    """Early stopping: stop after this many evaluations without a better best_metric (0 = off)."""
    retain_host_memory: bool = field(default=True, metadata=HOST)
    """Keep memory the process frees for reuse (glibc malloc; jaxloop.runtime.host_memory): XLA:CPU's per-call
    buffers then do not page-fault afresh each update (the small GPT's update: 84 -> 49-59 ms here)."""
    deterministic: bool = field(default=True, metadata=HOST)
    """GPU: ask XLA for deterministic kernels (XLA_FLAGS --xla_gpu_deterministic_ops=true, set before jax starts;
    jaxloop.runtime.determinism), so that every process computes the same bits; without it a fresh compile picks
    kernels by timing them. No effect on the CPU, which is deterministic already. torch_ref always asks torch
    for deterministic algorithms."""
    compile_cache: str = field(default="~/.cache/jaxloop/xla", metadata=HOST)
    """JAX's persistent compilation cache ("" = off): a second run or a resume of the same config loads its
    compiled steps from it (jaxloop.runtime.compilation)."""
    init_from: str = field(default="", metadata=HOST)
    """A run_dir (or its checkpoints/ directory) whose newest checkpoint's params initialise this fresh run
    (optimizer, step and data position start afresh); empty = the model's own seeded init. Or a Hugging Face
    GPT-2 directory (config.json + model.safetensors), which also gives the built-in GPT its shape
    (docs/language-models.md). Not allowed when the run resumes from a checkpoint of its own run_dir."""
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=TRAJECTORY)
    model: ModelConfig = field(default_factory=ModelConfig, metadata={**TRAJECTORY, **BUILTIN_TASK})
    data: DataConfig = field(default_factory=DataConfig, metadata=TRAJECTORY)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=HOST)
    log: LogConfig = field(default_factory=LogConfig, metadata=HOST)
    distributed: DistributedConfig = field(default_factory=DistributedConfig, metadata=HOST)
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata=PLAN)


def preset(name: str) -> Config:
    """The default Config of a preset."""
    if name == "digits":
        return Config()
    if name == "debug":
        return Config(
            preset="debug",
            run_dir="runs/debug",
            steps=20,
            batch_size=32,
            eval_every=10,
            log_every=1,
            optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=4, end_lr=1e-4), peak_lr=1e-2),
            model=ModelConfig(hidden=(32,)),
            checkpoint=CheckpointConfig(every=10),
            log=LogConfig(report=False),
        )
    if name == "shakespeare":
        return Config(
            preset="shakespeare",
            run_dir="runs/shakespeare",
            steps=2000,
            batch_size=32,
            eval_every=250,
            log_every=25,
            optim=OptimConfig(
                optimizer=AdamWConfig(weight_decay=0.1, b2=0.99),
                lr_schedule=WarmupCosineConfig(warmup_steps=100, end_lr=1e-4),
                peak_lr=1e-3,
            ),
            model=ModelConfig(kind="gpt", context=128, d_model=128, n_layers=4, n_heads=4),
            # 32 sequences per validation batch: on a CPU, forward passes of 32 ran at 2.3x the tokens/s
            # of batches of 256 (ctx 128; 1.4x at ctx 64), whose temporaries outgrow the caches
            data=DataConfig(source="text", val_fraction=0.1, eval_batch_size=32),
            checkpoint=CheckpointConfig(every=250),
        )
    if name == "gpt2-small":
        # GPT-2 small (124M with the padded vocabulary and tied embeddings) with nanoGPT's / llm.c's
        # optimizer: AdamW 6e-4, betas (0.9, 0.95), decay 0.1, warmup then cosine to 6e-5, clip 1.0
        return Config(
            preset="gpt2-small",
            run_dir="runs/gpt2-small",
            steps=5000,
            batch_size=16,
            eval_every=250,
            log_every=10,
            precision="auto",
            optim=OptimConfig(
                optimizer=AdamWConfig(weight_decay=0.1, b1=0.9, b2=0.95),
                lr_schedule=WarmupCosineConfig(warmup_steps=700, end_lr=6e-5),
                peak_lr=6e-4,
                clip_norm=1.0,
            ),
            model=ModelConfig(
                kind="gpt",
                context=1024,
                d_model=768,
                n_layers=12,
                n_heads=12,
                mlp_ratio=4,
                dropout=0.0,
                tie_embeddings=True,
                vocab_multiple=64,
                attention="auto",
                init="gpt2",
            ),
            # token shards (python -m jaxloop.prepare, or llm.c's / nanoGPT's own) given by --data.path; 200
            # validation batches per evaluation, as nanoGPT's eval_iters estimates (the same batches every time)
            data=DataConfig(source="tokens", val_fraction=0.05, eval_batch_size=16),
            eval_batches=200,
            checkpoint=CheckpointConfig(every=250),
        )
    if name == "gpt2-finetune":
        # nanoGPT's config/finetune_shakespeare.py: a pretrained GPT-2 (--init_from a Hugging Face directory, whose
        # config.json gives the model's shape) fine-tuned for 20 updates of 32 sequences at a constant 3e-5
        return Config(
            preset="gpt2-finetune",
            run_dir="runs/gpt2-finetune",
            steps=20,
            batch_size=8,
            eval_every=5,
            log_every=1,
            precision="auto",
            optim=OptimConfig(
                optimizer=AdamWConfig(weight_decay=0.1, b1=0.9, b2=0.95),
                lr_schedule=ConstantConfig(warmup_steps=0),
                peak_lr=3e-5,
                clip_norm=1.0,
                accum_steps=4,
            ),
            model=ModelConfig(
                kind="gpt",
                context=1024,
                d_model=768,
                n_layers=12,
                n_heads=12,
                vocab_size=50257,
                dropout=0.0,
                tie_embeddings=True,
                attention="auto",
            ),
            data=DataConfig(source="tokens", val_fraction=0.1, eval_batch_size=8),
            eval_batches=40,
            checkpoint=CheckpointConfig(every=5, keep_last=1),
        )
    raise ConfigError("preset", name, f"one of {', '.join(PRESETS)}")


INT32_MAX = 2**31 - 1
"""The largest size or token id a model takes: the arrays index, and the tokens are, int32."""


def padded_vocab(m: ModelConfig, from_data: int) -> int:
    """The GPT's vocabulary: model.vocab_size (or the data's, when 0) rounded up to model.vocab_multiple."""
    size = m.vocab_size or from_data
    return -(-size // m.vocab_multiple) * m.vocab_multiple


# ----------------------------------------------------------------------------- (de)serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict (tuples become lists), config.json's form; the optim section nested: its
    `optimizer` and `lr_schedule` each a mapping of the chosen class's `name` and fields, then the shared fields."""
    if isinstance(cfg, OptimConfig):
        shared = {f.name: getattr(cfg, f.name) for f in fields(OptimShared)}
        return _json({k: {"name": getattr(cfg, k).name, **_json(getattr(cfg, k))} for k in SECTIONS} | shared)
    out = _json(cfg)
    if isinstance(cfg, Config):
        out["optim"] = to_dict(cfg.optim)
    return out


def _json(obj: Any) -> Any:
    """A dataclass, or a dict of values some of which are dataclasses, as JSON-ready dicts and lists."""
    if isinstance(obj, dict):
        obj = {k: dataclasses.asdict(v) if is_dataclass(v) and not isinstance(v, type) else v for k, v in obj.items()}
    elif is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj))


def from_dict(d: dict[str, Any], base: Any = None, _cls: type = Config, _path: str = "") -> Any:
    """Build a Config from a (partial) nested dict over `base` (a Config; recursing, the `_cls` section of one);
    unknown keys are a ConfigError. The fields of an earlier version are read in today's terms (`upgrade`)."""
    base = base if base is not None else _cls()
    if _cls is Config:
        d = upgrade(d, base.memory.remat)
    if _cls is OptimConfig:  # an optim section alone (a saved config's, a record's): as it was stored
        return _optim_from_dict(d, base, _path or "optim.", stored=True)
    hints = get_type_hints(_cls)
    known = {f.name for f in fields(_cls)}
    updates: dict[str, Any] = {}
    for key, value in d.items():
        name = key.replace("-", "_")
        path = f"{_path}{name}"
        if name not in known:
            raise ConfigError(path, value, f"a known field{_did_you_mean(name, known, _path)}")
        current = getattr(base, name)
        if isinstance(current, OptimConfig):
            if not isinstance(value, dict):
                raise ConfigError(path, value, "a mapping of its fields")
            updates[name] = _optim_from_dict(value, current, path + ".")
        elif is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(path, value, "a mapping of its fields")
            updates[name] = from_dict(value, current, type(current), path + ".")
        else:
            updates[name] = _coerce(path, value, hints[name])
    return replace(base, **updates)


def upgrade(d: dict[str, Any], memory_remat: str = "none", stored: bool = False) -> dict[str, Any]:
    """A config dict (a file, a saved config.json) with the fields of earlier versions in today's form:
    model.remat (gone) true is memory.remat=blocks, false nothing. Beside memory.remat dots_saveable or full
    (`memory_remat`, the value it would apply over, where the dict has none), a ConfigError naming what to
    write instead; a `stored` run's config keeps that memory.remat (the plans compute the same math), and its
    optim section is written out nested and whole (the flat form of earlier versions read as it is: every
    value it stored kept)."""
    if stored and isinstance(d, dict) and isinstance(d.get("optim"), dict):
        d = {**d, "optim": to_dict(from_dict(d["optim"], _cls=OptimConfig))}
    model = d.get("model") if isinstance(d, dict) else None
    if not isinstance(model, dict) or "remat" not in model:
        return d
    old = model["remat"]
    if not isinstance(old, bool):
        raise ConfigError("model.remat", old, "true or false (model.remat=true is memory.remat=blocks now)")
    memory = d.get("memory")
    if not isinstance(memory, dict):
        memory = {}
    remat = memory.get("remat", memory_remat)
    upgraded = {**d, "model": {k: v for k, v in model.items() if k != "remat"}}
    if old and remat in ("none", "blocks"):
        upgraded["memory"] = {**memory, "remat": "blocks"}
    elif old and not stored:
        raise ConfigError(
            "model.remat",
            old,
            f"absent beside memory.remat={remat} (model.remat=true is memory.remat=blocks now): write one memory.remat",
        )
    return upgraded


def _optim_from_dict(d: dict[str, Any], base: OptimConfig, path: str, stored: bool = False) -> OptimConfig:
    """The optim section of a file or a saved config over `base`: `optimizer` and `lr_schedule` mappings (a
    `name` picks the class: `switched`), the shared fields, and any flat keys of
    the older form through rewrite_flat. A `stored` section, or a flat one that holds name, schedule and plateau
    (every config.json before the nested form held all 33 keys), keeps only what its choices read."""
    d = {k.replace("-", "_"): v for k, v in d.items()}
    changes: dict[str, Any] = {}
    for key in SECTIONS:
        if key not in d:
            continue
        value, menu, selector = d.pop(key), OPTIMIZERS if key == "optimizer" else SCHEDULES, f"{path}{key}.name"
        if not isinstance(value, dict):
            raise ConfigError(f"{path}{key}", value, "a mapping of the chosen class's name and fields")
        current = getattr(base, key)
        cls = _one_of(selector, value.get("name", current.name), menu)
        part = switched(current, cls)
        changes[key] = from_dict({k: v for k, v in value.items() if k != "name"}, part, cls, f"{path}{key}.")
    stored = stored or {"name", "schedule", "plateau"} <= set(d)
    return rewrite_flat(replace(base, **changes), d, path, stored=stored)


def _did_you_mean(name: str, known: set[str], section: str) -> str:
    """ "; did you mean optim.peak_lr?" for the closest known field, else the section's fields listed."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {section}{close[0]}?"
    return f" of {section.rstrip('.') or 'the config'} ({', '.join(sorted(known))})"


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Check a value from a config file against its annotated type (ints are accepted as floats)."""
    origin = getattr(hint, "__origin__", None)
    if origin is Literal:
        if value not in get_args(hint):
            raise ConfigError(path, value, f"one of {', '.join(map(str, get_args(hint)))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(is_int(v) for v in value):
            raise ConfigError(path, value, "a list of integers")
        return tuple(int(v) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "true or false")
        return value
    if hint is int:
        if not is_int(value):
            raise ConfigError(path, value, "an integer")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, value, "a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "a string")
        return value
    return value


# ----------------------------------------------------------------------------- validation


def validate(cfg: Config, check_paths: bool = True, builtin_task: bool = True) -> Config:
    """Return cfg if every field is allowed, else raise ConfigError for the first that is not.

    With check_paths, also checks that data.path is a readable non-empty file (text, npz) and that
    run_dir could be created or written, without creating anything. builtin_task=False (a run of a Task of
    one's own, which never reads data.path): data.path may be empty whatever data.source is.
    """
    o, m, d, c, lg = cfg.optim, cfg.model, cfg.data, cfg.checkpoint, cfg.log
    one_of("preset", cfg.preset, PRESETS)
    one_of("precision", cfg.precision, PRECISIONS)
    one_of("resume", cfg.resume, ("auto", "never", "must"))
    positive_int("steps", cfg.steps)
    if cfg.steps > MAX_STEPS:
        raise ConfigError(
            "steps",
            cfg.steps,
            f"an integer in [1, {MAX_STEPS}] (the learning-rate schedule is tabulated before the first update: "
            "about 60 MiB and a few seconds of start-up per million updates)",
        )
    positive_int("batch_size", cfg.batch_size)
    nonneg_int("seed", cfg.seed)
    if cfg.seed > MAX_SEED:
        raise ConfigError("seed", cfg.seed, f"an integer in [0, 2**63 - 1 = {MAX_SEED}]")
    nonneg_int("eval_every", cfg.eval_every)
    nonneg_int("eval_batches", cfg.eval_batches)
    positive_int("log_every", cfg.log_every)
    nonneg_int("updates_per_call", cfg.updates_per_call)
    positive_int("max_bad_steps", cfg.max_bad_steps)
    nonneg_int("patience", cfg.patience)
    if not cfg.run_dir:
        raise ConfigError("run_dir", cfg.run_dir, "a directory path")

    o.validate(cfg.steps)

    m.validate()
    if (m.kind == "gpt") != (d.source in ("text", "tokens")):
        raise ConfigError("model.kind", m.kind, f"gpt exactly when data.source is text or tokens (it is {d.source})")

    d.validate()
    if builtin_task and d.source in ("text", "npz") and not d.path:
        raise ConfigError("data.path", d.path, f"the path of a {d.source} file (data.source={d.source})")
    if builtin_task and d.source == "tokens" and not (d.path or d.train):
        raise ConfigError("data.path", d.path, "a token shard, a directory of shards or a glob (data.source=tokens)")
    if d.source == "digits" and d.path:
        raise ConfigError("data.path", d.path, "empty when data.source is digits")

    c.validate()
    if c.best_metric.startswith("ema_") and not o.ema_decay:
        raise ConfigError("checkpoint.best_metric", c.best_metric, "val_loss or val_acc unless optim.ema_decay > 0")
    lg.validate()
    cfg.memory.validate()
    if cfg.batch_size % cfg.memory.split:
        raise ConfigError("memory.split", cfg.memory.split, f"a divisor of batch_size ({cfg.batch_size})")
    cfg.distributed.validate()

    if check_paths:
        if d.source in ("text", "npz"):
            readable_file("data.path", d.path)
        if d.source == "tokens":
            from jaxloop.data.shards import shard_paths

            for name, value in (("data.path", d.path), ("data.train", d.train), ("data.val", d.val)):
                if value or name == "data.path" and not d.train:
                    shard_paths(value, name)  # ConfigError when it names no file
        writable_dir("run_dir", cfg.run_dir)
        if cfg.init_from and not os.path.isdir(cfg.init_from):
            raise ConfigError(
                "init_from",
                cfg.init_from,
                "empty or an existing run_dir or checkpoints directory (or a Hugging Face GPT-2 directory)",
            )
        if cfg.init_from and not (_holds_checkpoint(cfg.init_from) or is_hf_model_dir(cfg.init_from)):
            raise ConfigError(
                "init_from",
                cfg.init_from,
                f"a run_dir or checkpoints directory holding a checkpoint, "
                f"or a Hugging Face GPT-2 directory ({cfg.init_from} holds neither)",
            )
        if cfg.compile_cache:
            _makeable_dir("compile_cache", cfg.compile_cache)
    return cfg


def _holds_checkpoint(path: str) -> bool:
    """Whether a run_dir (or its checkpoints/ directory) holds a committed checkpoint: jaxloop's (a directory
    named by its update) or torch_ref's (a step_<update>.pt file), whichever loop reads it."""
    checkpoints = RunLayout.of(path).checkpoints
    try:
        return any(
            p.name.isdigit() and p.is_dir() or TORCH_CHECKPOINT.match(p.name) and p.is_file()
            for p in checkpoints.iterdir()
        )
    except OSError:
        return False


def is_hf_model_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a Hugging Face model directory: config.json and model.safetensors or pytorch_model.bin."""
    p = os.fspath(path)
    return os.path.isfile(os.path.join(p, "config.json")) and any(
        os.path.isfile(os.path.join(p, f)) for f in ("model.safetensors", "pytorch_model.bin")
    )


def _makeable_dir(name: str, path: str) -> None:
    """A directory, or a path where one can be made: no file stands at it or at an ancestor."""
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(
            name, path, f'a directory, or a path where one can be made ({probe} is a file), or "" for none'
        )


MAX_STEPS = 10_000_000
"""The most updates a run may have: the schedule's table (jaxloop.update.schedules.rates), a float64 rate per update
on the host and its float32 copy compiled into the training call, costs about 60 MiB of memory and a few seconds
of start-up per million updates (600 MiB and 23 s at the bound on a loaded 2-core machine: tests/test_bounded_inputs.py)."""
MAX_SEED = 2**63 - 1
"""The largest seed: jax's PRNG keys and the record order's SeedSequence take it as a 64-bit integer."""


def is_among(key: str, fields: tuple[str, ...]) -> bool:
    """Whether the dotted field `key` is one of `fields`, where an entry ending in "." names a whole section."""
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in fields)


def declared(key: str, cls: type | None = None, prefix: str = "", inherited: Any = None) -> dict[str, Any]:
    """{dotted field: its declared `key`} for every leaf field of `cls` (default Config): the value under `key`
    in the field's metadata, else its section's; None where no declaration covers a field."""
    cls = Config if cls is None else cls
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        value = f.metadata.get(key, inherited)
        if is_dataclass(hints[f.name]):
            out.update(declared(key, hints[f.name], f"{prefix}{f.name}.", value))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def field_rules(cls: type | None = None) -> dict[str, Rule | None]:
    """{dotted field: its Rule} for every leaf field of `cls` (default Config), from the declarations (RULE_KEY
    in a field's metadata, or its section's); None where no declaration covers a field (see TRAJECTORY)."""
    return declared(RULE_KEY, cls)


def builtin_task_fields() -> tuple[str, ...]:
    """The dotted fields only the built-in tasks read (declared BUILTIN_TASK, or in a section so declared)."""
    return tuple(k for k, v in declared(BUILTIN_TASK_KEY).items() if v)


def _fields_where(keep: Callable[[Rule], bool]) -> tuple[str, ...]:
    """The dotted fields whose rule passes `keep` (an undeclared field's rule is TRAJECTORY's), a section whose
    every field passes as one entry ending in "." (is_among): it also covers a field a saved config of
    another version holds in that section."""
    rules = {k: keep(r if r is not None else TRAJECTORY[RULE_KEY]) for k, r in field_rules().items()}
    sections = {k.rpartition(".")[0] + "." for k in rules if "." in k}
    whole = sorted(s for s in sections if all(ok for k, ok in rules.items() if k.startswith(s)))
    top = [s for s in whole if not any(s != o and s.startswith(o) for o in whole)]
    return tuple([k for k, ok in rules.items() if ok and not is_among(k, tuple(top))] + top)


# Fields a resumed run may change: they do not alter the computed trajectory (HOST and PLAN fields).
RESUME_SAFE = _fields_where(lambda r: r.resume_safe)


def resume_conflicts(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The dotted fields in which cfg differs from the saved config of the run it would resume.

    Only fields that change the trajectory count; `steps` counts unless cfg.allow_steps_change. A field
    missing from `saved` counts as its default (a config saved before the field existed).
    """
    current, before = _flatten(to_dict(cfg)), _saved_fields(saved)
    # another optimizer or schedule class is one conflict, its name (not each field the two classes differ in)
    switched = tuple(f"optim.{k}." for k in SECTIONS if current[f"optim.{k}.name"] != before.get(f"optim.{k}.name"))
    conflicts = []
    for key in sorted(set(current) | set(before)):
        if is_among(key, RESUME_SAFE) or key.startswith(switched) and not key.endswith(".name"):
            continue
        if key == "steps" and cfg.allow_steps_change:
            continue
        if current.get(key) != before.get(key):
            conflicts.append(f"{key}: {short_repr(before.get(key))} -> {short_repr(current.get(key))}")
    return conflicts


def changed_fields(saved: dict[str, Any], cfg: Config) -> dict[str, list[Any]]:
    """Every field that differs from the saved config, as {field: [before, after]} (for the record: a field the
    saved config lacks, saved before the field existed, is recorded as None -> its value)."""
    current, before = _flatten(to_dict(cfg)), _flatten(upgrade(saved, stored=True))
    return {
        k: [before.get(k), current.get(k)]
        for k in sorted(set(current) | set(before))
        if current.get(k) != before.get(k)
    }


def _saved_fields(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config's dotted fields; a field it lacks (saved before the field existed) had its default's effect."""
    before = _flatten(upgrade(saved, stored=True))
    chosen = tuple(f"optim.{k}." for k in SECTIONS) if any(k.startswith("optim.") for k in before) else ()
    defaults = {k: v for k, v in _flatten(to_dict(Config())).items() if not k.startswith(chosen)}
    return {**defaults, **before}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
