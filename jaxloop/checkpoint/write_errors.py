"""What a failed checkpoint write becomes: one line naming the step and path, the error, the free space there
and the last good (committed) checkpoint (CheckpointWriteError's text, and the CLI's for a full disk met
elsewhere)."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

from jaxloop.config.errors import CheckpointWriteError
from jaxloop.rundir.layout import RunLayout
from jaxloop.update.memory_plan import size


def _chain(error: BaseException) -> list[BaseException]:
    """The error and its causes and contexts, outermost first (each once)."""
    out: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in out:
        out.append(link)
        link = link.__cause__ or link.__context__
    return out


def is_disk_full(error: BaseException) -> bool:
    """Whether a failed write ran out of space: ENOSPC anywhere in the chain, or tensorstore's report of it
    (RESOURCE_EXHAUSTED ... No space left on device)."""
    return any(
        getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) or "os_error_code='28'" in str(e)
        for e in _chain(error)
    )


def committed_steps(directory: str | Path) -> list[int]:
    """The steps whose checkpoint is complete on disk: Orbax renames N.orbax-checkpoint-tmp to N only
    after every item is written, so the digit-named directories are the committed ones."""
    try:
        return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def size_text(n: int | None) -> str:
    return "an unknown amount" if n is None else size(n)


def write_error(error: BaseException, directory: Path, handed: list[int]) -> CheckpointWriteError:
    """The one line a failed save becomes: the step and path, the error, the free space, the last good step.
    `handed`: the steps given to Orbax so far; the failed one is the step Orbax's error names, else the
    first of them not committed (Orbax commits in order)."""
    text = " ".join(f"{type(e).__name__}: {e}" for e in _chain(error))
    found = re.search(r"/(\d+)\.orbax-checkpoint-tmp", text)  # the step whose write failed, as Orbax names it
    good = committed_steps(directory)
    pending = [s for s in handed if s > (good[-1] if good else -1)]
    failed = int(found.group(1)) if found else pending[0] if pending else None
    if is_disk_full(error):
        cause = "the disk is full (No space left on device)"
    else:
        cause = root_cause(error)
    last = (
        f"the last good checkpoint is update {good[-1]}, which a rerun resumes from"
        if good
        else "no checkpoint was completed; a rerun starts afresh"
    )
    which = f"the checkpoint of update {failed}" if failed is not None else "a checkpoint"
    return CheckpointWriteError(
        f"{which} could not be written to {directory}: {cause}; {size_text(free_bytes(directory))} free there; {last}"
    )


def disk_full_line(error: OSError, run_dir: str | Path) -> str:
    """The one line of a full disk met outside a checkpoint save (metrics.jsonl, config.json, ...)."""
    good = committed_steps(RunLayout.of(Path(run_dir).absolute()).checkpoints)
    last = (
        f"the last good checkpoint is update {good[-1]}, which a rerun resumes from"
        if good
        else "no checkpoint was completed; a rerun starts afresh"
    )
    return (
        f"{error.filename or run_dir} could not be written: the disk is full (No space left on device); "
        f"{size_text(free_bytes(Path(run_dir)))} free there; {last}"
    )


def root_cause(error: BaseException) -> str:
    """The innermost cause's type and first line (orbax wraps tensorstore's precise error), shortened."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:300]
