"""Atomic file replacement: a reader, or a run killed at any instant, sees the whole old file or the whole new one.

    atomic_write_text(layout.summary, json.dumps(summary))

The bytes go to a temporary file in the same directory (`.NAME.XXXXXXXX.tmp`), which is fsynced and renamed
over the target (rename(2) is atomic within a filesystem), then the directory is fsynced so the rename itself
survives a power loss. A failed write (a full disk, say) deletes its temporary file and raises the OSError.
Every file a run rewrites (config.json, metadata.json, summary.json, metrics.jsonl on resume, the report, the
lock's holder record, vocab.json) goes through here. Imports nothing of the project.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

TMP_SUFFIX = ".tmp"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of atomic_write's temporaries (left only by a process killed inside a write)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename into it) durable; a filesystem that cannot fsync a directory is left be."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mode(path: Path) -> int:
    """The permissions the new file gets: the old file's, else what open() would give (0o666 less the umask)."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        pass
    try:  # the umask without setting it (os.umask would change it process-wide, under other threads)
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = 0o022
    return 0o666 & ~umask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` by `data` atomically and durably (see the module doc)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _mode(path))  # mkstemp's file is 0o600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """atomic_write_bytes of `text` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))
