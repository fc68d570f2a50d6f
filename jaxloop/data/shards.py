"""Token shards on disk: llm.c's format and nanoGPT's headerless .bin, read through mmap.

Imports numpy only (torch_ref reads shards through jaxloop.data.sources too). Formats, detected per file:

- llm.c: a header of 256 little-endian int32, then the tokens. header[0] is the magic, header[1] the
  version, header[2] the token count: magic 20240520 version 1 holds uint16 tokens (GPT-2's shards,
  modded-nanogpt's fineweb10B), magic 20240801 version 7 uint32 tokens (llm.c's Llama-3 variant). The
  file holds exactly 1024 + count * itemsize bytes, as llm.c's loader asserts.
- nanoGPT: a headerless array of uint16 tokens (its prepare.py's train.bin / val.bin), taken only when
  the first int32 is neither magic. A directory whose meta.json says "format": "llm.c" (what
  `python -m jaxloop.prepare` writes) must hold llm.c shards only: a shard without the magic is corrupt.

Splits: the split word in a file's name (SPLIT_WORDS: train; val, valid, validation, eval; test, listed and
never read), or data.train / data.val; `token_splits` says how (docs/data.md#splits-of-token-shards).

Nothing here reads a whole shard: a shard is its path, the byte offset of its tokens, their dtype and
count, and `tokens()` maps it (file-backed pages, not the process's anonymous memory). Training windows are read
with pread (`Shard.windows`): a file that shrinks under a read is a short read, ShardShrank, never SIGBUS.
"""

from __future__ import annotations

import glob
import json
import mmap
import os
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from jaxloop.config.errors import short_repr
from jaxloop.config.run import INT32_MAX, ConfigError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMC_FORMATS = {20240520: (1, np.dtype(np.uint16)), 20240801: (7, np.dtype(np.uint32))}
"""llm.c's magic -> (version, token dtype)."""
META_FILE = "meta.json"
"""The sidecar beside the shards: vocab_size, tokenizer, dtype, format (written by jaxloop.prepare)."""
SPLIT_WORDS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "eval": "val", "test": "test"}
"""A word of a shard's file name -> the split it names (llm.c's, nanoGPT's and Hugging Face's names)."""


@dataclass(frozen=True)
class Shard:
    """`count` tokens of dtype `dtype` starting at byte `offset` of the file at `path`."""

    path: str
    offset: int
    dtype: str
    count: int
    format: str  # "llm.c" or "nanogpt"

    @property
    def end(self) -> int:
        """The byte just past this shard's tokens in its file: the file must hold at least this many bytes."""
        return self.offset + self.count * np.dtype(self.dtype).itemsize

    def tokens(self) -> np.ndarray:
        """The shard's tokens, memory-mapped read-only (nothing is read until indexed). The array's buffer is the
        file's mmap, which `check_size` asks for the file's current size."""
        if self.count == 0:
            return np.zeros(0, self.dtype)
        with open(self.path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # keeps its own descriptor
        if hasattr(mmap, "MADV_RANDOM"):
            # windows are read at random offsets: no read-ahead around each page fault (tens of ms a fault
            # on a busy machine, measured, instead of well under one)
            mapping.madvise(mmap.MADV_RANDOM)
        return np.frombuffer(mapping, dtype=self.dtype, count=self.count, offset=self.offset)

    def check_size(self, tokens: np.ndarray, split: str) -> None:
        """ShardShrank when the file under `tokens` (this shard's `tokens()`) now ends before the tokens it maps:
        reading a page past a mapped file's end is SIGBUS, which kills the process with no word. The size is an
        fstat of the mapping's own descriptor (the file it maps, even if its path was replaced since)."""
        mapping = getattr(tokens.base, "obj", None)
        size = mapping.size() if isinstance(mapping, mmap.mmap) else None
        if size is not None and size < self.end:
            raise self.shrank(size, split)

    def windows(self, fd: int, first: np.ndarray, length: int, split: str) -> np.ndarray:
        """Tokens first[i] .. first[i] + length - 1 of this shard for each i, [len(first), length], read from `fd`
        (this shard's file, os.open) with pread: a file that shrank under the read is a short read, ShardShrank,
        where a memory map's page past the new end would be SIGBUS (in a grain worker too, racing the truncation)."""
        itemsize = np.dtype(self.dtype).itemsize
        nbytes = length * itemsize
        parts = [os.pread(fd, nbytes, self.offset + int(f) * itemsize) for f in first]
        if any(len(p) != nbytes for p in parts):
            raise self.shrank(os.fstat(fd).st_size, split)
        return np.frombuffer(b"".join(parts), self.dtype).reshape(len(parts), length)

    def shrank(self, size: int, split: str) -> ShardShrank:
        """The one line for this shard's file found holding `size` bytes, fewer than its tokens need."""
        return ShardShrank(
            f"token shard {self.path} shrank during the run: it holds {size} bytes now, the "
            f"{split} split reads its bytes up to {self.end}; nothing past its end was read. Put "
            "the whole file back and resume (the run continues from its last checkpoint)"
        )

    def part(self, start: int, stop: int) -> Shard:
        """Tokens start .. stop - 1 of this shard, as a shard."""
        size = np.dtype(self.dtype).itemsize
        return replace(self, offset=self.offset + start * size, count=max(stop - start, 0))


class ShardShrank(ConfigError):
    """A shard's file got shorter while a run was reading it (truncated or rewritten in place): one line naming
    the file and the sizes (exit status 2, like any bad input), instead of the SIGBUS the read would end in."""

    def __init__(self, message: str):  # one argument: it pickles (grain's worker processes raise it too)
        ValueError.__init__(self, message)
        self.field_path, self.value, self.allowed = "data.path", None, message


def _bad(path: str, why: str) -> ConfigError:
    return ConfigError("data.path", path, f"a token shard (llm.c's format or nanoGPT's uint16 .bin): {why}")


def read_shard(path: str, require_header: bool = False) -> Shard:
    """The shard at `path`, its format detected from its first bytes; ConfigError (naming the file) when a
    header is corrupt: a version that does not match its magic, a token count the file does not hold."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise ConfigError("data.path", path, f"a readable token shard ({e.strerror})") from None
    magic = int(np.frombuffer(head[:4], "<i4")[0]) if len(head) >= 4 else None
    if magic in LLMC_FORMATS:
        version, dtype = LLMC_FORMATS[magic]
        if len(head) < HEADER_BYTES:
            raise _bad(path, f"llm.c magic {magic} but only {size} bytes, less than the {HEADER_BYTES}-byte header")
        header = np.frombuffer(head, "<i4")
        if int(header[1]) != version:
            raise _bad(path, f"llm.c magic {magic} with version {int(header[1])} (that magic's version is {version})")
        count = int(header[2])
        expected = HEADER_BYTES + count * dtype.itemsize
        if count < 0 or expected != size:
            raise _bad(
                path,
                f"its header says {count} {dtype.name} tokens ({expected} bytes with the header), "
                f"the file has {size} bytes",
            )
        return Shard(os.path.abspath(path), HEADER_BYTES, dtype.name, count, "llm.c")
    if require_header:
        shown = "none (the file is empty)" if magic is None else magic
        raise _bad(
            path,
            f"bad magic {shown}: {META_FILE} beside it says llm.c shards, whose magic is "
            f"{' or '.join(map(str, LLMC_FORMATS))}",
        )
    if size % 2:
        raise _bad(path, f"no llm.c header, and {size} bytes is not a whole number of uint16 tokens (nanoGPT's .bin)")
    return Shard(os.path.abspath(path), 0, "uint16", size // 2, "nanogpt")


def write_shard(path: str, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """Write `tokens` as one llm.c shard (uint16: magic 20240520 version 1; uint32: 20240801 version 7),
    through a temporary file renamed into place."""
    dtype_ = np.dtype(dtype)
    magic = next((m for m, (_, d) in LLMC_FORMATS.items() if d == dtype_), None)
    if magic is None:
        raise ValueError(f"dtype must be uint16 or uint32, got {dtype}")
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype_).max):
        raise ValueError(f"token ids outside {dtype_.name}'s range")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = magic, LLMC_FORMATS[magic][0], tokens.size
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype_.newbyteorder("<")).tobytes())
    os.replace(tmp, path)


def shard_paths(path: str, field: str = "data.path") -> list[str]:
    """The files `path` names (the value of `field`): a directory's *.bin files, a glob's matches, or the one
    file; sorted."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.bin")))
        where = f"a directory holding .bin token shards ({path} holds none)"
    elif glob.has_magic(path):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        where = "a glob matching token shard files (it matches none)"
    else:
        files = [path] if os.path.isfile(path) else []
        where = "an existing token shard file, a directory of shards, or a glob"
    if not files:
        raise ConfigError(field, path, where)
    return files


def split_of(path: str) -> str | None:
    """The split a shard's file name names with one of SPLIT_WORDS as a word (letters between non-letters:
    tiny_shakespeare_val.bin, fineweb_train_000001.bin, x_validation_000000.bin): "train", "val" or "test"; None
    when it names none. ConfigError when it names two (train_val.bin)."""
    name = os.path.basename(path)
    named = sorted({SPLIT_WORDS[w] for w in re.findall(r"[a-z]+", name.lower()) if w in SPLIT_WORDS})
    if len(named) > 1:
        raise ConfigError(
            "data.path",
            path,
            f"token shards whose file names name one split each ({name} names "
            f"{' and '.join(named)}): rename it, or name the splits with --data.train and --data.val",
            python=f"token shards whose file names name one split each ({name} names "
            f"{' and '.join(named)}): rename it, or name the splits with DataConfig(train=..., val=...)",
        )
    return named[0] if named else None


def is_val(path: str) -> bool:
    """Whether a shard's file name marks it as validation data (fineweb_val_000000.bin, x_validation_000000.bin)."""
    return split_of(path) == "val"


def read_meta(files: list[str]) -> dict[str, Any] | None:
    """meta.json beside the first shard, or None if there is none."""
    path = os.path.join(os.path.dirname(os.path.abspath(files[0])), META_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("data.path", path, f"a readable JSON {META_FILE} ({e})") from None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= INT32_MAX:
        raise ConfigError(
            "data.path",
            path,
            f"a {META_FILE} whose vocab_size is an integer in [1, {INT32_MAX}] "
            f"(got {short_repr(vocab)}; token ids are int32)",
        )
    return meta


@dataclass(frozen=True)
class TokenSplits:
    """The shards of each split, meta.json (or None), and how the files were assigned (`by`: "file names",
    "data.train and data.val", or either way followed by how validation was cut from the training files)."""

    train: list[Shard]
    val: list[Shard]
    test: list[Shard]
    meta: dict[str, Any] | None
    by: str
    val_fraction: float

    def record(self) -> dict[str, Any]:
        """The assignment as metadata.json keeps it: per split its files (absolute paths) and tokens."""
        return {
            "assigned_by": self.by,
            **({"val_fraction": self.val_fraction} if "val_fraction" in self.by else {}),
            **{
                name: {"files": [s.path for s in shards], "tokens": int(sum(s.count for s in shards))}
                for name, shards in (("train", self.train), ("val", self.val), ("test", self.test))
            },
        }


def _shown(paths: list[str], most: int = 4) -> str:
    names = [os.path.basename(p) for p in paths]
    return ", ".join(names) if len(names) <= most else ", ".join(names[: most - 1]) + f", ... {names[-1]}"


def token_splits(path: str, val_fraction: float, train: str = "", val: str = "") -> TokenSplits:
    """The token shards of each split (module doc of jaxloop.data.sources; docs/data.md#token-shards).

    `train` / `val` (data.train, data.val: globs, a directory or a file) name the splits outright. Otherwise
    the files of `path` are assigned by the split word in their names (split_of): train, val (also valid,
    validation, eval) and test, which is listed and never read. A directory where some files name a split and
    others none is refused naming them; where none does, every file is a training file. Without validation
    files, each training file's first floor(n * (1 - val_fraction)) tokens train and the rest validate
    (contiguous, as the text source splits its characters).
    """
    if train:
        train_files = shard_paths(train, "data.train")
        val_files = shard_paths(val, "data.val") if val else []
        both = sorted(set(train_files) & set(val_files))
        if both:
            raise ConfigError(
                "data.val",
                val,
                f"files that data.train ({train}) does not match too ({_shown(both)} "
                "would be trained and validated on)",
            )
        test_files, by, files = [], "data.train and data.val", train_files + val_files
    else:
        files = shard_paths(path)
        named = {f: split_of(f) for f in files}
        nameless = [f for f in files if named[f] is None]
        if nameless and len(nameless) < len(files):
            some = [f for f in files if named[f] is not None]
            which = (
                f"{_shown(nameless)} name{'s' if len(nameless) == 1 else ''} no split, {_shown(some)} "
                f"do{'es' if len(some) == 1 else ''}"
            )
            raise ConfigError(
                "data.path",
                path,
                f"token shards whose file names all name a split or none do "
                f"({which}): rename them (train, val, test as a word in the name), move them away, "
                "or name the splits with --data.train and --data.val",
                python=f"token shards whose file names all name a split or none do ({which}): rename "
                "them, move them away, or name the splits with DataConfig(train=..., val=...)",
            )
        train_files = [f for f in files if named[f] in ("train", None)]
        val_files = [f for f in files if named[f] == "val"]
        test_files = [f for f in files if named[f] == "test"]
        by = "file names" if not nameless else "no file names a split"
        if not train_files:
            raise ConfigError(
                "data.path",
                path,
                f"shards for training too (only {_shown(files)} were found, named as validation or test files)",
            )
    meta = read_meta(files)
    llmc = meta is not None and meta.get("format") == "llm.c"
    train_shards = [read_shard(f, require_header=llmc) for f in train_files]
    val_shards = [read_shard(f, require_header=llmc) for f in val_files]
    test_shards = [read_shard(f, require_header=llmc) for f in test_files]
    if not val_shards:
        by = f"{'data.train' if train else by}; validation: the last data.val_fraction of each training file"
        cut = [int(np.floor(s.count * (1.0 - val_fraction))) for s in train_shards]
        val_shards = [s.part(c, s.count) for s, c in zip(train_shards, cut)]
        train_shards = [s.part(0, c) for s, c in zip(train_shards, cut)]
    return TokenSplits(train_shards, val_shards, test_shards, meta, by, val_fraction)
