"""Reading the few options a command handles itself out of argv, before tyro parses the rest: the one scanner
of `python -m jaxloop.train` (--preset, --config, --run_dir, --resume), torch_ref.train (--clip) and
jaxloop.schedule (--at, --plot). Imports nothing but jaxloop.config.errors."""

from __future__ import annotations

from jaxloop.config.errors import UsageError


def take_option(argv: list[str], name: str, keep: bool = False, allowed: str = "") -> str | None:
    """The value of the first `name VALUE` or `name=VALUE` in argv (None when absent), removed from argv unless
    `keep`. `name` last with no value: a UsageError "NAME needs a value" (then `: allowed`, when given)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value{': ' + allowed if allowed else ''}")
            value = argv[i + 1]
            if not keep:
                del argv[i : i + 2]
            return value
        if arg.startswith(name + "="):
            if not keep:
                del argv[i]
            return arg.split("=", 1)[1]
    return None


def take_flag(argv: list[str], *names: str) -> bool:
    """Whether argv holds one of the valueless flags `names` (each spelling of one flag); every occurrence is
    removed from argv."""
    found = [a for a in argv if a in names]
    argv[:] = [a for a in argv if a not in names]
    return bool(found)


# Other training loops' flags -> jaxloop's: (the flag to give instead, what differs). The names of Hugging Face's
# Trainer (TrainingArguments), Lightning's Trainer (`--trainer.` is set aside) and nanoGPT's train.py. docs/training.md
# shows this table (tests/test_argv.py holds the two equal); jaxloop takes none of them as an alias, because their
# meanings differ in details (epochs against updates, eval_steps as a cadence), and says which flag to give instead.
FOREIGN_FLAGS: dict[str, tuple[str, str]] = {
    "max_steps": ("--steps", "optimizer updates in all"),
    "max_iters": ("--steps", "optimizer updates in all"),
    "max_epochs": ("--steps", "jaxloop counts updates, not epochs: steps = epochs x training examples / batch_size"),
    "num_train_epochs": (
        "--steps",
        "jaxloop counts updates, not epochs: steps = epochs x training examples / batch_size",
    ),
    "epochs": ("--steps", "jaxloop counts updates, not epochs: steps = epochs x training examples / batch_size"),
    "learning_rate": (
        "--optim.peak_lr",
        "the rate after warmup; --optim.init_lr starts the warmup, --optim.end_lr ends the schedule",
    ),
    "lr": (
        "--optim.peak_lr",
        "the rate after warmup; --optim.init_lr starts the warmup, --optim.end_lr ends the schedule",
    ),
    "min_lr": ("--optim.end_lr", "the schedule's last rate"),
    "lr_scheduler_type": ("--optim.schedule", "the schedule's name; --help lists them"),
    "optim": ("--optim.name", "the optimizer's name; --help lists them"),
    "warmup_steps": ("--optim.warmup_steps", "updates of linear warmup"),
    "warmup_iters": ("--optim.warmup_steps", "updates of linear warmup"),
    "weight_decay": ("--optim.weight_decay", "decoupled (AdamW's), on matrices and embeddings only"),
    "adam_beta1": ("--optim.b1", "Adam's first-moment decay"),
    "beta1": ("--optim.b1", "Adam's first-moment decay"),
    "adam_beta2": ("--optim.b2", "Adam's second-moment decay"),
    "beta2": ("--optim.b2", "Adam's second-moment decay"),
    "adam_epsilon": ("--optim.eps", "Adam's epsilon"),
    "max_grad_norm": ("--optim.clip_norm", "global-norm clipping, 0 = off"),
    "gradient_clip_val": ("--optim.clip_norm", "global-norm clipping, 0 = off"),
    "grad_clip": ("--optim.clip_norm", "global-norm clipping, 0 = off"),
    "gradient_accumulation_steps": ("--optim.accum_steps", "micro-batches per update"),
    "accumulate_grad_batches": ("--optim.accum_steps", "micro-batches per update"),
    "per_device_train_batch_size": ("--batch_size", "the global batch of one update, over all devices"),
    "train_batch_size": ("--batch_size", "the global batch of one update, over all devices"),
    "bf16": ("--precision bf16", "matmuls in bf16, the rest float32; bf16_full: the whole model in bf16"),
    "fp16": ("--precision fp16", "matmuls in fp16 with a dynamic loss scale"),
    "dtype": ("--precision", "fp32, bf16, bf16_full, fp16, fp64 or auto"),
    "eval_steps": ("--eval_every", "updates between evaluations"),
    "eval_interval": ("--eval_every", "updates between evaluations"),
    "val_check_interval": ("--eval_every", "updates between evaluations"),
    "eval_iters": ("--eval_batches", "batches per evaluation, 0 = the whole validation set"),
    "limit_val_batches": ("--eval_batches", "batches per evaluation, 0 = the whole validation set"),
    "logging_steps": ("--log_every", "updates between metric records"),
    "log_every_n_steps": ("--log_every", "updates between metric records"),
    "log_interval": ("--log_every", "updates between metric records"),
    "save_steps": ("--checkpoint.every", "updates between checkpoints"),
    "save_total_limit": ("--checkpoint.keep_last", "the newest checkpoints kept"),
    "output_dir": ("--run_dir", "the run's directory; a run resumes from its own: --run_dir DIR alone"),
    "out_dir": ("--run_dir", "the run's directory; a run resumes from its own: --run_dir DIR alone"),
    "default_root_dir": ("--run_dir", "the run's directory; a run resumes from its own: --run_dir DIR alone"),
    "resume_from_checkpoint": (
        "--run_dir",
        "a run resumes from its own directory: --run_dir DIR, with --resume must to insist",
    ),
}


def foreign_flag(flag: str) -> str | None:
    """ "jaxloop's is --steps: optimizer updates in all" for another loop's flag (`--max_steps`,
    `--trainer.max_epochs`, `--gradient-accumulation-steps`), None for any other."""
    name = flag.lstrip("-").replace("-", "_").removeprefix("trainer.")
    if name not in FOREIGN_FLAGS:
        return None
    instead, meaning = FOREIGN_FLAGS[name]
    return f"jaxloop's is {instead}: {meaning}"
