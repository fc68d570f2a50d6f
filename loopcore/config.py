"""The run configuration: one tree of frozen dataclasses, presets, and validation.

Imports no jax and no torch: jaxloop, torch_ref and the CLI all read this module. A Config is
validated once, at the edge (`validate`), and saved with every run (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, get_args, get_type_hints

from loopcore.errors import ConfigError  # its home is loopcore.errors; still importable from here
from loopcore.optim_fields import SCHEDULE_FIELDS as SCHEDULE_READS

PRECISIONS = ("fp32", "bf16", "bf16_full", "fp16", "fp64", "auto")
REMATS = ("none", "blocks", "dots_saveable", "full")
PRESETS = ("digits", "shakespeare", "debug", "gpt2-small")
ATTENTIONS = ("auto", "xla", "cudnn")


OPTIMIZERS = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "lion")
SCHEDULES = ("warmup_cosine", "constant", "linear", "polynomial", "step", "multistep", "exponential",
             "cosine_restarts", "one_cycle", "wsd", "inverse_sqrt", "plateau")


@dataclass(frozen=True)
class PlateauConfig:
    """ReduceLROnPlateau (optim.schedule=plateau): at each evaluation checkpoint.best_metric, by
    checkpoint.best_mode, decides whether the rate is multiplied by `factor` (torch's rule and names)."""

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


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule (torch's semantics and names; docs/optimizers.md),
    global-norm clipping and gradient accumulation."""

    name: Literal["adamw", "adam", "sgd", "rmsprop", "adagrad", "lion"] = "adamw"
    """adamw (decoupled decay, torch.optim.AdamW), adam (decay as L2 in the gradient, torch.optim.Adam), sgd,
    rmsprop, adagrad (as torch.optim's), lion (the paper's, optax.lion)."""
    schedule: Literal["warmup_cosine", "constant", "linear", "polynomial", "step", "multistep", "exponential",
                      "cosine_restarts", "one_cycle", "wsd", "inverse_sqrt", "plateau"] = "warmup_cosine"
    """The rate per update, after the linear warmup (init_lr -> peak_lr; not one_cycle, plateau): warmup_cosine
    (cosine to end_lr at steps), constant, linear (to end_lr), polynomial (PolynomialLR, to 0), step, multistep,
    exponential, cosine_restarts (CosineAnnealingWarmRestarts), one_cycle (OneCycleLR), wsd (warmup-stable-decay),
    inverse_sqrt, plateau (ReduceLROnPlateau at each evaluation). peak_lr is torch's `lr` (one_cycle's max_lr).
    `python -m jaxloop.schedule` shows it."""
    peak_lr: float = 3e-3
    """Learning rate at the end of warmup."""
    init_lr: float = 0.0
    """Learning rate of the first update (start of the linear warmup)."""
    end_lr: float = 3e-5
    """The floor: warmup_cosine's and cosine_restarts' eta_min, linear's and wsd's final rate, held past steps."""
    warmup_steps: int = 50
    """Updates of linear warmup from init_lr to peak_lr before the schedule (0 = start at peak_lr); the
    schedule's own update count starts after it, as inside torch's SequentialLR."""
    weight_decay: float = 1e-4
    """Weight decay on matrices and embeddings, never on biases or norm scales: decoupled (scaled by the rate)
    for adamw and lion, added to the gradient (L2, torch's weight_decay) for adam, sgd, rmsprop, adagrad."""
    b1: float = 0.9
    """First-moment decay (adamw, adam; lion's interpolation beta1)."""
    b2: float = 0.999
    """Second-moment decay (adamw, adam; lion's momentum beta2, 0.99 in its paper)."""
    eps: float = 1e-8
    """Epsilon added to the root of the second moment, outside the square root (adamw, adam, rmsprop,
    adagrad; torch's Adagrad defaults to 1e-10)."""
    momentum: float = 0.0
    """Momentum (sgd, rmsprop), as torch's: sgd's buffer starts as the first gradient."""
    dampening: float = 0.0
    """sgd: the gradient enters the momentum buffer times (1 - dampening), from the second update on."""
    nesterov: bool = False
    """sgd: Nesterov momentum (needs momentum > 0 and dampening 0, as torch)."""
    alpha: float = 0.99
    """rmsprop: decay of the squared-gradient average."""
    centered: bool = False
    """rmsprop: divide by the root of the gradient's variance estimate instead of its second moment."""
    lr_decay: float = 0.0
    """adagrad: the rate of update t (1-based) is divided by 1 + (t - 1) * lr_decay."""
    initial_accumulator_value: float = 0.0
    """adagrad: starting value of the sum of squared gradients."""
    step_size: int = 0
    """step: multiply the rate by gamma every step_size updates (after warmup)."""
    gamma: float = 0.1
    """step, multistep, exponential: the multiplicative factor."""
    milestones: tuple[int, ...] = ()
    """multistep: updates (counted after warmup) at which the rate is multiplied by gamma, increasing."""
    power: float = 1.0
    """polynomial: the rate is peak_lr * (1 - t / (steps - warmup_steps)) ** power."""
    t_0: int = 0
    """cosine_restarts: updates of the first cosine cycle (from peak_lr to end_lr)."""
    t_mult: int = 1
    """cosine_restarts: each cycle is t_mult times as long as the previous."""
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
    decay_steps: int = 0
    """wsd: the final updates over which the rate decays from peak_lr to end_lr (the rest is stable)."""
    decay_type: Literal["linear", "cosine", "1-sqrt"] = "cosine"
    """wsd: the decay's shape (Hugging Face's decay_type)."""
    timescale: int = 0
    """inverse_sqrt: after warmup the rate is peak_lr / sqrt((t + timescale) / timescale), t counted after
    warmup (0 = warmup_steps, or 10000 without warmup, as Hugging Face's)."""
    plateau: PlateauConfig = field(default_factory=PlateauConfig)
    """plateau: ReduceLROnPlateau's settings."""
    clip_norm: float = 1.0
    """Clip the mean accumulated gradient to this global L2 norm (0 = no clipping)."""
    accum_steps: int = 1
    """Micro-batches accumulated per update (optax.MultiSteps K); one update per K micro-batches."""
    ema_decay: float = 0.0
    """Exponential moving average of params, updated each update (0 = off)."""


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
    remat: bool = False
    """Rematerialise GPT blocks in the backward pass (less memory, more compute); the same as
    memory.remat=blocks (this field is the one torch_ref reads)."""
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


@dataclass(frozen=True)
class DataConfig:
    """Where the records come from and how the loader feeds them."""

    source: Literal["digits", "text", "npz", "tokens"] = "digits"
    """digits (scikit-learn's bundled 8x8 digits), text (a UTF-8 file, characters), npz (x, y arrays), tokens
    (token shards: llm.c's format or nanoGPT's .bin, memory-mapped; docs/data.md)."""
    path: str = ""
    """File for the text or npz source; for tokens one shard, a directory of shards or a glob."""
    val_fraction: float = 0.2
    """Fraction of records held out for validation (npz: ignored when x_val/y_val exist)."""
    workers: int = 0
    """Loader worker processes (0 = in the main process); batches are the same for every count."""
    prefetch: int = 2
    """Batches put on the device ahead of the step."""
    eval_batch_size: int = 0
    """Validation batch size (0 = batch_size)."""


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
    price_per_hour: float = 0.0
    """Machine price in $/hour, for the cost line of the report."""
    report: bool = True
    """Write report.md and its PNGs at the end of the run."""


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


@dataclass(frozen=True)
class MemoryConfig:
    """The memory plan of the update (jaxloop.memory): checked against the device before the first update,
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
    under nn.remat: the built-in GPT, or a Linen module with a `remat` field); dots_saveable or full
    (jax.checkpoint policies around the whole loss: keep only matmul outputs, or nothing)."""


@dataclass(frozen=True)
class Config:
    """A jaxloop run. Flags are the dotted field paths, e.g. --optim.peak_lr 3e-4."""

    preset: str = "digits"
    """Starting point for every other default: digits, shakespeare or debug."""
    run_dir: str = "runs/digits"
    """Directory for config.json, metrics.jsonl, checkpoints and the report."""
    seed: int = 0
    """Seeds initialisation, data order and per-step randomness."""
    steps: int = 500
    """Optimizer updates to run (each consumes optim.accum_steps micro-batches)."""
    batch_size: int = 64
    """Global micro-batch size (records per micro-batch, over all processes)."""
    eval_every: int = 100
    """Validate over the whole validation split (or eval_batches' subset) every this many updates (0 = only
    at the end)."""
    eval_batches: int = 0
    """Evaluate a fixed, seeded subset of this many validation batches (data.eval_batch_size records each), the
    same at every evaluation (nanoGPT's eval_iters, Lightning's limit_val_batches); 0 = the whole split."""
    log_every: int = 10
    """Record metrics every this many updates."""
    updates_per_call: int = 0
    """Most updates the loop dispatches in one device call (one lax.scan); 0 = auto (up to 50). Every call
    ends on the evaluation, checkpoint and end cadences; logs come from the call's per-update metrics. The
    host waits for the device once per call: larger calls cost less, smaller ones answer a signal sooner."""
    precision: Literal["fp32", "bf16", "bf16_full", "fp16", "fp64", "auto"] = "fp32"
    """fp32; bf16: matmuls in bf16, the rest fp32 (torch.autocast's way); bf16_full: the whole model in bf16;
    fp16: as bf16 with fp16 matmuls and a dynamic loss scale; fp64: float64 throughout (the run turns on JAX's
    64-bit mode itself; for parity); auto: bf16 on an accelerator, fp32 on a CPU (the run's config.json
    records the one chosen)."""
    resume: Literal["auto", "never", "must"] = "auto"
    """auto: resume from run_dir if it holds a checkpoint; never: start fresh; must: fail without one."""
    allow_steps_change: bool = False
    """Accept a different `steps` when resuming (the schedule then differs from the original run)."""
    max_bad_steps: int = 20
    """Stop the run after this many consecutive skipped (non-finite) updates."""
    patience: int = 0
    """Early stopping: stop after this many evaluations without a better best_metric (0 = off)."""
    retain_host_memory: bool = True
    """Keep memory the process frees for reuse (glibc malloc; jaxloop.host_memory): XLA:CPU's per-call
    buffers then do not page-fault afresh each update (the small GPT's update: 84 -> 49-59 ms here)."""
    deterministic: bool = True
    """GPU: ask XLA for deterministic kernels (XLA_FLAGS --xla_gpu_deterministic_ops=true, set before jax starts;
    jaxloop.determinism), so that every process computes the same bits; without it a fresh compile picks
    kernels by timing them. No effect on the CPU, which is deterministic already. torch_ref always asks torch
    for deterministic algorithms."""
    compile_cache: str = "~/.cache/jaxloop/xla"
    """The compilation caches ("" = off): JAX's persistent cache, and for the built-in tasks the compiled calls
    stored by config and source (jaxloop.executables); a second run or a resume loads its compiled steps."""
    init_from: str = ""
    """A run_dir (or its checkpoints/ directory) whose newest checkpoint's params initialise this fresh run
    (optimizer, step and data position start afresh); empty = the model's own seeded init. Not allowed
    when the run resumes from a checkpoint of its own run_dir."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


def preset(name: str) -> Config:
    """The default Config of a preset."""
    if name == "digits":
        return Config()
    if name == "debug":
        return Config(
            preset="debug", run_dir="runs/debug", steps=20, batch_size=32, eval_every=10, log_every=1,
            optim=OptimConfig(peak_lr=1e-2, warmup_steps=4, end_lr=1e-4),
            model=ModelConfig(hidden=(32,)),
            checkpoint=CheckpointConfig(every=10),
            log=LogConfig(report=False),
        )
    if name == "shakespeare":
        return Config(
            preset="shakespeare", run_dir="runs/shakespeare", steps=2000, batch_size=32,
            eval_every=250, log_every=25,
            optim=OptimConfig(peak_lr=1e-3, end_lr=1e-4, warmup_steps=100, weight_decay=0.1, b2=0.99),
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
            preset="gpt2-small", run_dir="runs/gpt2-small", steps=5000, batch_size=16, eval_every=250,
            log_every=10, precision="auto",
            optim=OptimConfig(peak_lr=6e-4, end_lr=6e-5, warmup_steps=700, weight_decay=0.1, b1=0.9, b2=0.95,
                              clip_norm=1.0),
            model=ModelConfig(kind="gpt", context=1024, d_model=768, n_layers=12, n_heads=12, mlp_ratio=4,
                              dropout=0.0, tie_embeddings=True, vocab_multiple=64, attention="auto", init="gpt2"),
            # token shards (python -m jaxloop.prepare, or llm.c's / nanoGPT's own) given by --data.path; 200
            # validation batches per evaluation, as nanoGPT's eval_iters estimates (the same batches every time)
            data=DataConfig(source="tokens", val_fraction=0.05, eval_batch_size=16),
            eval_batches=200, checkpoint=CheckpointConfig(every=250),
        )
    raise ConfigError("preset", name, f"one of {', '.join(PRESETS)}")


def padded_vocab(m: ModelConfig, from_data: int) -> int:
    """The GPT's vocabulary: model.vocab_size (or the data's, when 0) rounded up to model.vocab_multiple."""
    size = m.vocab_size or from_data
    return -(-size // m.vocab_multiple) * m.vocab_multiple


# ----------------------------------------------------------------------------- (de)serialisation


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def from_dict(d: dict[str, Any], base: Config | None = None, _cls: type = Config, _path: str = "") -> Any:
    """Build a Config from a (partial) nested dict over `base`; unknown keys are a ConfigError."""
    base = base if base is not None else _cls()
    hints = get_type_hints(_cls)
    known = {f.name for f in fields(_cls)}
    updates: dict[str, Any] = {}
    for key, value in d.items():
        name = key.replace("-", "_")
        path = f"{_path}{name}"
        if name not in known:
            raise ConfigError(path, value, f"a known field{_did_you_mean(name, known, _path)}")
        current = getattr(base, name)
        if is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(path, value, "a mapping of its fields")
            updates[name] = from_dict(value, current, type(current), path + ".")
        else:
            updates[name] = _coerce(path, value, hints[name])
    return replace(base, **updates)


def _did_you_mean(name: str, known: set[str], section: str) -> str:
    """"; did you mean optim.peak_lr?" for the closest known field, else the section's fields listed."""
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
        if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
            raise ConfigError(path, value, "a list of integers")
        return tuple(int(v) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "true or false")
        return value
    if hint is int:
        if not _is_int(value):
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- validation


def validate(cfg: Config, check_paths: bool = True) -> Config:
    """Return cfg if every field is allowed, else raise ConfigError for the first that is not.

    With check_paths, also checks that data.path is a readable non-empty file (text, npz) and that
    run_dir could be created or written, without creating anything.
    """
    o, m, d, c, lg = cfg.optim, cfg.model, cfg.data, cfg.checkpoint, cfg.log
    _choice("preset", cfg.preset, PRESETS)
    _choice("precision", cfg.precision, PRECISIONS)
    _choice("resume", cfg.resume, ("auto", "never", "must"))
    _positive_int("steps", cfg.steps)
    if cfg.steps > MAX_STEPS:
        raise ConfigError("steps", cfg.steps, f"an integer in [1, {MAX_STEPS}] (the learning-rate schedule is a "
                          f"table of one float64 rate per update: {MAX_STEPS * 8 // 2**20} MiB at the bound)")
    _positive_int("batch_size", cfg.batch_size)
    _nonneg_int("seed", cfg.seed)
    if cfg.seed > MAX_SEED:
        raise ConfigError("seed", cfg.seed, f"an integer in [0, 2**63 - 1 = {MAX_SEED}]")
    _nonneg_int("eval_every", cfg.eval_every)
    _nonneg_int("eval_batches", cfg.eval_batches)
    _positive_int("log_every", cfg.log_every)
    _nonneg_int("updates_per_call", cfg.updates_per_call)
    _positive_int("max_bad_steps", cfg.max_bad_steps)
    _nonneg_int("patience", cfg.patience)
    if not cfg.run_dir:
        raise ConfigError("run_dir", cfg.run_dir, "a directory path")

    _positive_float("optim.peak_lr", o.peak_lr)
    _nonneg_float("optim.init_lr", o.init_lr)
    _nonneg_float("optim.end_lr", o.end_lr)
    _nonneg_int("optim.warmup_steps", o.warmup_steps)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    read = SCHEDULE_READS[o.schedule]  # a schedule that does not read a field leaves its default alone
    if "init_lr" in read and o.init_lr > o.peak_lr:
        raise ConfigError("optim.init_lr", o.init_lr, f"at most optim.peak_lr ({o.peak_lr})")
    if "end_lr" in read and o.end_lr > o.peak_lr:
        raise ConfigError("optim.end_lr", o.end_lr, f"at most optim.peak_lr ({o.peak_lr})")
    if "warmup_steps" in read and o.warmup_steps > cfg.steps:
        raise ConfigError("optim.warmup_steps", o.warmup_steps, f"an integer in [0, steps={cfg.steps}]")
    _nonneg_float("optim.weight_decay", o.weight_decay)
    for name, v in (("optim.b1", o.b1), ("optim.b2", o.b2)):
        _float(name, v)
        if not 0.0 <= v < 1.0:
            raise ConfigError(name, v, "a number in [0, 1)")
    _positive_float("optim.eps", o.eps)
    if o.eps < FLOAT32_TINY:  # it would round to 0 in float32: Adam's 0 / (sqrt(0) + 0) is NaN
        raise ConfigError("optim.eps", o.eps, f"a number >= {FLOAT32_TINY:.4g} (the smallest normal float32)")
    _nonneg_float("optim.clip_norm", o.clip_norm)
    _positive_int("optim.accum_steps", o.accum_steps)
    _float("optim.ema_decay", o.ema_decay)
    if not 0.0 <= o.ema_decay < 1.0:
        raise ConfigError("optim.ema_decay", o.ema_decay, "a number in [0, 1) (0 = off)")
    _validate_optimizer_and_schedule(cfg)

    _choice("model.kind", m.kind, ("mlp", "gpt"))
    _choice("model.activation", m.activation, ("gelu", "relu", "tanh"))
    if not m.hidden or not all(_is_int(h) and h > 0 for h in m.hidden):
        raise ConfigError("model.hidden", m.hidden, "one or more positive integers")
    for name in ("context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
        _positive_int(f"model.{name}", getattr(m, name))
    if m.d_model % m.n_heads:
        raise ConfigError("model.n_heads", m.n_heads, f"a divisor of model.d_model ({m.d_model})")
    _float("model.dropout", m.dropout)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", m.dropout, "a number in [0, 1)")
    _nonneg_int("model.vocab_size", m.vocab_size)
    _positive_int("model.vocab_multiple", m.vocab_multiple)
    _choice("model.attention", m.attention, ATTENTIONS)
    _choice("model.init", m.init, ("normal", "gpt2"))
    if (m.kind == "gpt") != (d.source in ("text", "tokens")):
        raise ConfigError("model.kind", m.kind, f"gpt exactly when data.source is text or tokens (it is {d.source})")

    _choice("data.source", d.source, ("digits", "text", "npz", "tokens"))
    _float("data.val_fraction", d.val_fraction)
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", d.val_fraction, "a number in (0, 1)")
    _nonneg_int("data.workers", d.workers)
    _nonneg_int("data.prefetch", d.prefetch)
    _nonneg_int("data.eval_batch_size", d.eval_batch_size)
    if d.source in ("text", "npz") and not d.path:
        raise ConfigError("data.path", d.path, f"the path of a {d.source} file (data.source={d.source})")
    if d.source == "tokens" and not d.path:
        raise ConfigError("data.path", d.path, "a token shard, a directory of shards or a glob (data.source=tokens)")
    if d.source == "digits" and d.path:
        raise ConfigError("data.path", d.path, "empty when data.source is digits")

    _nonneg_int("checkpoint.every", c.every)
    _positive_int("checkpoint.keep_last", c.keep_last)
    _nonneg_int("checkpoint.keep_best", c.keep_best)
    _nonneg_int("checkpoint.keep_every", c.keep_every)
    _choice("checkpoint.best_metric", c.best_metric, ("val_loss", "val_acc", "ema_val_loss", "ema_val_acc"))
    if c.best_metric.startswith("ema_") and not o.ema_decay:
        raise ConfigError("checkpoint.best_metric", c.best_metric, "val_loss or val_acc unless optim.ema_decay > 0")
    _choice("checkpoint.best_mode", c.best_mode, ("min", "max"))

    _choice("log.progress", lg.progress, ("auto", "bar", "plain", "off"))
    _nonneg_int("log.profile_start", lg.profile_start)
    _nonneg_int("log.profile_steps", lg.profile_steps)
    _nonneg_float("log.price_per_hour", lg.price_per_hour)

    mem = cfg.memory
    _nonneg_int("memory.budget", mem.budget)
    if not isinstance(mem.auto_fit, bool):
        raise ConfigError("memory.auto_fit", mem.auto_fit, "true or false")
    _positive_int("memory.split", mem.split)
    if cfg.batch_size % mem.split:
        raise ConfigError("memory.split", mem.split, f"a divisor of batch_size ({cfg.batch_size})")
    _choice("memory.remat", mem.remat, REMATS)

    dist = cfg.distributed
    _positive_int("distributed.num_processes", dist.num_processes)
    _positive_int("distributed.fsdp", dist.fsdp)  # divides the device count: checked when jax starts
    if not _is_int(dist.process_id) or not 0 <= dist.process_id < dist.num_processes:
        raise ConfigError("distributed.process_id", dist.process_id,
                          f"an integer in [0, distributed.num_processes={dist.num_processes})")
    if dist.num_processes > 1:
        host, _, port = dist.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("distributed.coordinator", dist.coordinator,
                              "host:port of process 0 (needed when distributed.num_processes > 1)")

    if check_paths:
        if d.source in ("text", "npz"):
            _readable_file("data.path", d.path)
        if d.source == "tokens":
            from loopcore.shards import shard_paths

            shard_paths(d.path)  # ConfigError when it names no file
        _writable_dir("run_dir", cfg.run_dir)
        if cfg.init_from and not os.path.isdir(cfg.init_from):
            raise ConfigError("init_from", cfg.init_from, "empty or an existing run_dir or checkpoints directory")
    return cfg


def _validate_optimizer_and_schedule(cfg: Config) -> None:
    """The optimizer's and the schedule's own fields (docs/optimizers.md), and that no field either ignores
    was set away from the preset's value (loopcore.optim_fields)."""
    from loopcore.optim_fields import readers, unread_fields

    o, p = cfg.optim, cfg.optim.plateau
    _choice("optim.name", o.name, OPTIMIZERS)
    _choice("optim.schedule", o.schedule, SCHEDULES)
    for name, value, default, who in unread_fields(o, preset(cfg.preset).optim):
        raise ConfigError(f"optim.{name}", value, f"its default {default!r} ({who} does not read it; read by "
                          f"{', '.join(readers(name.split('.')[0]))})")
    for name in ("momentum", "alpha"):
        _float(f"optim.{name}", getattr(o, name))
        if not 0.0 <= getattr(o, name) < 1.0:
            raise ConfigError(f"optim.{name}", getattr(o, name), "a number in [0, 1)")
    _float("optim.dampening", o.dampening)
    if not 0.0 <= o.dampening <= 1.0:
        raise ConfigError("optim.dampening", o.dampening, "a number in [0, 1]")
    for name in ("nesterov", "centered", "three_phase"):
        if not isinstance(getattr(o, name), bool):
            raise ConfigError(f"optim.{name}", getattr(o, name), "true or false")
    if o.nesterov and (o.momentum <= 0 or o.dampening != 0):
        raise ConfigError("optim.nesterov", o.nesterov, f"false unless optim.momentum > 0 and optim.dampening = 0 "
                          f"(they are {o.momentum} and {o.dampening}; torch's rule)")
    _nonneg_float("optim.lr_decay", o.lr_decay)
    _nonneg_float("optim.initial_accumulator_value", o.initial_accumulator_value)
    _positive_float("optim.gamma", o.gamma)
    _nonneg_float("optim.power", o.power)
    _nonneg_int("optim.step_size", o.step_size)
    _nonneg_int("optim.t_0", o.t_0)
    _positive_int("optim.t_mult", o.t_mult)
    _nonneg_int("optim.decay_steps", o.decay_steps)
    _nonneg_int("optim.timescale", o.timescale)
    if not isinstance(o.milestones, tuple) or not all(_is_int(m) and m > 0 for m in o.milestones) or \
            list(o.milestones) != sorted(set(o.milestones)):
        raise ConfigError("optim.milestones", o.milestones, "increasing positive integers")
    _float("optim.pct_start", o.pct_start)
    if not 0.0 < o.pct_start < 1.0:
        raise ConfigError("optim.pct_start", o.pct_start, "a number in (0, 1)")
    _positive_float("optim.div_factor", o.div_factor)
    _positive_float("optim.final_div_factor", o.final_div_factor)
    _choice("optim.anneal_strategy", o.anneal_strategy, ("cos", "linear"))
    _choice("optim.decay_type", o.decay_type, ("linear", "cosine", "1-sqrt"))
    _float("optim.plateau.factor", p.factor)
    if not 0.0 <= p.factor < 1.0:
        raise ConfigError("optim.plateau.factor", p.factor, "a number in [0, 1)")
    _nonneg_int("optim.plateau.patience", p.patience)
    _nonneg_float("optim.plateau.threshold", p.threshold)
    _choice("optim.plateau.threshold_mode", p.threshold_mode, ("rel", "abs"))
    _nonneg_int("optim.plateau.cooldown", p.cooldown)
    _nonneg_float("optim.plateau.min_lr", p.min_lr)
    _nonneg_float("optim.plateau.eps", p.eps)

    decay_span = cfg.steps - (o.warmup_steps if "warmup_steps" in SCHEDULE_READS[o.schedule] else 0)
    needs = {"step": ("step_size", o.step_size >= 1, "an integer >= 1"),
             "multistep": ("milestones", len(o.milestones) > 0, "one or more increasing positive integers"),
             "cosine_restarts": ("t_0", o.t_0 >= 1, "an integer >= 1"),
             "wsd": ("decay_steps", 1 <= o.decay_steps <= decay_span,
                     f"an integer in [1, steps - warmup_steps = {decay_span}]")}
    if o.schedule in needs:
        name, ok, allowed = needs[o.schedule]
        if not ok:
            raise ConfigError(f"optim.{name}", getattr(o, name), f"{allowed} (optim.schedule={o.schedule})")
    if o.schedule in ("linear", "polynomial") and decay_span < 1:
        raise ConfigError("optim.warmup_steps", o.warmup_steps, f"less than steps ({cfg.steps}) for "
                          f"optim.schedule={o.schedule}, which decays over the updates after warmup")
    if o.schedule == "one_cycle":
        # torch's phase ends: pct_start * steps - 1 (and 2 * pct_start * steps - 2), each after the previous
        up = o.pct_start * cfg.steps - 1
        if up <= 0:
            raise ConfigError("optim.pct_start", o.pct_start, f"more than 1 / steps = {1 / cfg.steps:.4g} "
                              "(one_cycle's rising phase must hold at least one update)")
        if o.three_phase and not up < 2 * o.pct_start * cfg.steps - 2 < cfg.steps - 1:
            raise ConfigError("optim.pct_start", o.pct_start, f"in ({1 / cfg.steps:.4g}, "
                              f"{(cfg.steps + 1) / (2 * cfg.steps):.4g}) for three_phase (three non-empty phases)")


def _choice(name: str, v: Any, allowed: tuple) -> None:
    if v not in allowed:
        raise ConfigError(name, v, f"one of {', '.join(allowed)}")


def _float(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(name, v, "a finite number")


FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (numpy.finfo(numpy.float32).tiny)."""


def _positive_float(name: str, v: Any) -> None:
    _float(name, v)
    if v <= 0:
        raise ConfigError(name, v, "a number > 0")


def _nonneg_float(name: str, v: Any) -> None:
    _float(name, v)
    if v < 0:
        raise ConfigError(name, v, "a number >= 0")


MAX_STEPS = 100_000_000
"""The most updates a run may have: the schedule's table (jaxloop.schedule.rates) holds a float64 rate per
update on the host and its float32 copy on the device (1.2 GB together at the bound)."""
MAX_SEED = 2**63 - 1
"""The largest seed: jax's PRNG keys and the record order's SeedSequence take it as a 64-bit integer."""


def _positive_int(name: str, v: Any) -> None:
    if not _is_int(v) or v <= 0:
        raise ConfigError(name, v, "an integer >= 1")


def _nonneg_int(name: str, v: Any) -> None:
    if not _is_int(v) or v < 0:
        raise ConfigError(name, v, "an integer >= 0")


def _readable_file(name: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(name, path, "an existing file")
    if not os.access(path, os.R_OK):
        raise ConfigError(name, path, "a readable file")
    if os.path.getsize(path) == 0:
        raise ConfigError(name, path, "a non-empty file")


def _writable_dir(name: str, path: str) -> None:
    """The directory exists and is writable, or its nearest existing ancestor is."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(name, path, f"a writable directory ({probe} is not writable)")


# Fields a resumed run may change: they do not alter the computed trajectory. `deterministic` chooses how
# XLA:GPU picks kernels, not what they compute (and a run saved before the field existed lacks it).
# `model.remat` recomputes the same forward pass in the backward pass: the same math (up to the rounding
# of other fusions), other memory and time; so do the memory plans (memory.*: jaxloop.memory).
RESUME_SAFE = (
    "run_dir", "resume", "allow_steps_change", "compile_cache", "retain_host_memory", "eval_every", "log_every",
    "deterministic",
    "updates_per_call", "max_bad_steps", "patience", "init_from",
    "data.workers", "data.prefetch", "data.eval_batch_size", "checkpoint.", "log.", "distributed.",
    "model.remat",
    "memory.",
)

# Fields no compiled call depends on: the key of a stored executable (jaxloop.executables) leaves them out;
# a change of any other field compiles afresh. Its own rule, not RESUME_SAFE: a field may be resume-safe
# and still change the compiled code (model.remat, memory.*), or change the run and not the code (seed: initial
# values and data order). Host-side fields; what the arguments' shapes and shardings carry (the eval batch
# size, the mesh of distributed.*); the call's size, which names the call; XLA_FLAGS, in the key itself.
NOT_COMPILED = (
    "run_dir", "resume", "allow_steps_change", "compile_cache", "retain_host_memory", "eval_every", "eval_batches",
    "log_every",
    "deterministic", "updates_per_call", "max_bad_steps", "patience", "init_from", "seed",
    "data.workers", "data.prefetch", "data.eval_batch_size", "checkpoint.", "log.", "distributed.",
)


def is_among(key: str, fields: tuple[str, ...]) -> bool:
    """Whether the dotted field `key` is one of `fields`, where an entry ending in "." names a whole section."""
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in fields)


def compiled_fields(cfg: Config, excluded: tuple[str, ...]) -> dict[str, Any]:
    """cfg as {dotted field: value}, without the `excluded` fields (is_among)."""
    return {k: v for k, v in _flatten(to_dict(cfg)).items() if not is_among(k, excluded)}


def resume_conflicts(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The dotted fields in which cfg differs from the saved config of the run it would resume.

    Only fields that change the trajectory count; `steps` counts unless cfg.allow_steps_change. A field
    missing from `saved` counts as its default (a config saved before the field existed).
    """
    current = _flatten(to_dict(cfg))
    # a field the saved config lacks (it was saved before the field existed) had its default's effect
    before = {**_flatten(to_dict(Config())), **_flatten(saved)}
    conflicts = []
    for key in sorted(set(current) | set(before)):
        if is_among(key, RESUME_SAFE):
            continue
        if key == "steps" and cfg.allow_steps_change:
            continue
        if current.get(key) != before.get(key):
            conflicts.append(f"{key}: {before.get(key)!r} -> {current.get(key)!r}")
    return conflicts


def changed_fields(saved: dict[str, Any], cfg: Config) -> dict[str, list[Any]]:
    """Every field that differs from the saved config, as {field: [before, after]} (for the record)."""
    current, before = _flatten(to_dict(cfg)), _flatten(saved)
    return {k: [before.get(k), current.get(k)] for k in sorted(set(current) | set(before))
            if current.get(k) != before.get(k)}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
