"""The data half of a run's identity: the files each split reads and a cheap fingerprint of each, kept in
metadata.json's "data" section. A run resumed on data that changed since it last started is refused before
anything is written, like a changed config or model (jaxloop.rundir.model_identity), unless data.allow_changed says
the change is meant.

A file's fingerprint is its size in bytes and the SHA-256 of BLOCKS blocks of BLOCK bytes at evenly spaced
offsets from its first byte to its last (the whole file when it is no larger): a few reads whatever the file's
size. A change of size is always seen; a change of content when it touches a sampled block (a shard's header,
its first and last tokens, 14 places between). Imports neither numpy nor jax.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from jaxloop.config.run import ConfigError
from jaxloop.rundir.layout import RunLayout

BLOCK = 4096
BLOCKS = 16
SHOWN = 3
"""How many differences a refusal names."""


def file_fingerprint(path: str) -> dict[str, Any]:
    """{"bytes": the file's size, "sampled_sha256": the SHA-256 of its sampled blocks (module doc)}."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest = hashlib.sha256()
        if size <= BLOCK * BLOCKS:
            digest.update(f.read())
        else:
            for i in range(BLOCKS):
                f.seek((size - BLOCK) * i // (BLOCKS - 1))
                digest.update(f.read(BLOCK))
    return {"bytes": size, "sampled_sha256": digest.hexdigest()}


def data_record(source: str, path: str, files: list[str], splits: dict[str, Any] | None = None) -> dict[str, Any]:
    """metadata.json's "data": the source and data.path, each split's files and tokens (`splits`, token shards),
    and the fingerprint of every file read (keyed by absolute path)."""
    paths = list(dict.fromkeys(os.path.abspath(f) for f in files))
    return {
        "source": source,
        "path": path,
        **({"splits": splits} if splits is not None else {}),
        "files": {p: file_fingerprint(p) for p in paths},
    }


def _name(path: str) -> str:
    return os.path.basename(path)


def data_differences(run: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the data a run recorded and the data now, one phrase each: files added, gone,
    resized or with other content, then splits assigned other files."""
    before, after = run.get("files") or {}, now.get("files") or {}
    out = []
    for path, was in before.items():
        new = after.get(path)
        if new is None:
            out.append(f"{path}: read by the run, not now")
        elif new["bytes"] != was["bytes"]:
            out.append(f"{path}: {was['bytes']} bytes in the run, {new['bytes']} now")
        elif new["sampled_sha256"] != was["sampled_sha256"]:
            out.append(f"{path}: other content at the same size ({new['bytes']} bytes)")
    out += [f"{path}: read now, not by the run" for path in after if path not in before]
    for split, was in (run.get("splits") or {}).items():
        new = (now.get("splits") or {}).get(split)
        if (
            isinstance(was, dict)
            and isinstance(new, dict)
            and (was.get("files"), was.get("tokens")) != (new.get("files"), new.get("tokens"))
        ):
            out.append(
                f"the {split} split: {len(was['files'])} files, {was['tokens']} tokens in the run, "
                f"{len(new['files'])} files, {new['tokens']} tokens now"
            )
    return out


def check_same_data(
    layout: RunLayout, now: dict[str, Any] | None, resuming: bool, allow: bool
) -> dict[str, Any] | None:
    """`now` (the data record of this start) once a resume on other data than the run's last start recorded in
    metadata.json is refused (ConfigError, exit 2: its CLI message names flags, str() Config arguments). With
    `allow` (data.allow_changed) the run goes on and the record keeps what changed ("changed_on_resume")."""
    if not resuming or now is None:
        return now
    metadata = layout.read_json(layout.metadata)
    run = metadata.get("data") if isinstance(metadata, dict) else None
    if not isinstance(run, dict) or not isinstance(run.get("files"), dict):
        return now  # a run from before data records were kept: nothing to compare
    differences = data_differences(run, now)
    if not differences:
        return now
    if allow:
        return {**now, "changed_on_resume": differences}
    more = len(differences) - SHOWN
    shown = "; ".join(differences[:SHOWN]) + (f" (and {more} more)" if more > 0 else "")
    root = layout.root
    why = (
        f"the data the run trained on, unchanged since it last started ({shown}; the fingerprints are in "
        f"{layout.metadata})"
    )
    flags = (
        f"To train on the new data, start a new run: --run_dir NEW_DIR (add --init_from {root} to start from "
        f"this run's weights); to continue this run on it on purpose: --data.allow_changed; to continue it as "
        f"it was, put the original files back"
    )
    python = (
        f"To train on the new data, start a new run: Config(run_dir=NEW_DIR, init_from={str(root)!r}, ...); "
        f"to continue this run on it on purpose: DataConfig(allow_changed=True); to continue it as it was, "
        f"put the original files back"
    )
    raise ConfigError("data.path", now.get("path") or now["source"], f"{why}. {flags}", python=f"{why}. {python}")


def data_lines(record: dict[str, Any] | None) -> list[str]:
    """The console lines naming the files of each split and their tokens (token shards), one per split, and
    what changed on a resume that accepted it."""
    if not record or not isinstance(record.get("splits"), dict):
        return []
    splits = record["splits"]
    by = str(splits.get("assigned_by", ""))
    cut = "val_fraction" in by
    fraction = splits.get("val_fraction")
    how = {
        "train": f"by {by.split(';')[0]}" if not by.startswith("no file") else "no file names a split",
        "val": (f"the last {fraction:g} of each training file: data.val_fraction" if cut else f"by {by}"),
        "test": "listed, never read",
    }
    lines = []
    for split in ("train", "val", "test"):
        files, tokens = splits[split]["files"], splits[split]["tokens"]
        if split == "test" and not files:
            continue
        names = [_name(f) for f in dict.fromkeys(files)]
        shown = ", ".join(names) if len(names) <= 4 else ", ".join(names[:3]) + f", ..., {names[-1]}"
        count = f"{len(names)} file{'s' if len(names) != 1 else ''}"
        lines.append(f"data {split} ({how[split]}): {count}, {tokens:,} tokens: {shown}")
    for change in record.get("changed_on_resume", []):
        lines.append(f"data changed since the run last started, continuing on it (data.allow_changed): {change}")
    return lines
