"""Token shards on disk: llm.c's format and nanoGPT's headerless .bin, read through np.memmap.

Imports numpy only (torch_ref reads shards through jaxloop.core.sources too). Formats, detected per file:

- llm.c: a header of 256 little-endian int32, then the tokens. header[0] is the magic, header[1] the
  version, header[2] the token count: magic 20240520 version 1 holds uint16 tokens (GPT-2's shards,
  modded-nanogpt's fineweb10B), magic 20240801 version 7 uint32 tokens (llm.c's Llama-3 variant). The
  file holds exactly 1024 + count * itemsize bytes, as llm.c's loader asserts.
- nanoGPT: a headerless array of uint16 tokens (its prepare.py's train.bin / val.bin), taken only when
  the first int32 is neither magic. A directory whose meta.json says "format": "llm.c" (what
  `python -m jaxloop.prepare` writes) must hold llm.c shards only: a shard without the magic is corrupt.

Nothing here reads a whole shard: a shard is its path, the byte offset of its tokens, their dtype and
count, and `tokens()` maps it (file-backed pages, not the process's anonymous memory).
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

from jaxloop.core.config import INT32_MAX, ConfigError
from jaxloop.core.errors import short_repr

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMC_FORMATS = {20240520: (1, np.dtype(np.uint16)), 20240801: (7, np.dtype(np.uint32))}
"""llm.c's magic -> (version, token dtype)."""
META_FILE = "meta.json"
"""The sidecar beside the shards: vocab_size, tokenizer, dtype, format (written by jaxloop.prepare)."""
_VAL = re.compile(r"(^|[^a-z])val([^a-z]|$)", re.IGNORECASE)


@dataclass(frozen=True)
class Shard:
    """`count` tokens of dtype `dtype` starting at byte `offset` of the file at `path`."""

    path: str
    offset: int
    dtype: str
    count: int
    format: str  # "llm.c" or "nanogpt"

    def tokens(self) -> np.ndarray:
        """The shard's tokens, memory-mapped read-only (nothing is read until indexed)."""
        if self.count == 0:
            return np.zeros(0, self.dtype)
        tokens = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))
        mapping = getattr(tokens, "_mmap", None)  # numpy's mmap.mmap object
        if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
            # windows are read at random offsets: no read-ahead around each page fault (tens of ms a fault
            # on a busy machine, measured, instead of well under one)
            mapping.madvise(mmap.MADV_RANDOM)
        return tokens

    def part(self, start: int, stop: int) -> Shard:
        """Tokens start .. stop - 1 of this shard, as a shard."""
        size = np.dtype(self.dtype).itemsize
        return replace(self, offset=self.offset + start * size, count=max(stop - start, 0))


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
            raise _bad(path, f"its header says {count} {dtype.name} tokens ({expected} bytes with the header), "
                             f"the file has {size} bytes")
        return Shard(os.path.abspath(path), HEADER_BYTES, dtype.name, count, "llm.c")
    if require_header:
        shown = "none (the file is empty)" if magic is None else magic
        raise _bad(path, f"bad magic {shown}: {META_FILE} beside it says llm.c shards, whose magic is "
                         f"{' or '.join(map(str, LLMC_FORMATS))}")
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


def shard_paths(path: str) -> list[str]:
    """The files data.path names: a directory's *.bin files, a glob's matches, or the one file; sorted."""
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
        raise ConfigError("data.path", path, where)
    return files


def is_val(path: str) -> bool:
    """Whether a shard's file name marks it as validation data (fineweb_val_000000.bin, val.bin)."""
    return bool(_VAL.search(os.path.basename(path)))


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
        raise ConfigError("data.path", path, f"a {META_FILE} whose vocab_size is an integer in [1, {INT32_MAX}] "
                          f"(got {short_repr(vocab)}; token ids are int32)")
    return meta


def token_splits(path: str, val_fraction: float) -> tuple[list[Shard], list[Shard], dict[str, Any] | None]:
    """(train shards, validation shards, meta.json or None) of data.path.

    Files whose name holds "val" as a word (val.bin, fineweb_val_000000.bin) are the validation split and
    the others the training split. Without any such file, each file's first floor(n * (1 - val_fraction))
    tokens train and the rest validate (contiguous, as the text source splits its characters).
    """
    files = shard_paths(path)
    meta = read_meta(files)
    llmc = meta is not None and meta.get("format") == "llm.c"
    shards = [read_shard(f, require_header=llmc) for f in files]
    val = [s for s in shards if is_val(s.path)]
    train = [s for s in shards if not is_val(s.path)]
    if val and not train:
        raise ConfigError("data.path", path, "shards for training too (only files named *val* were found)")
    if not val:
        cut = [int(np.floor(s.count * (1.0 - val_fraction))) for s in shards]
        train = [s.part(0, c) for s, c in zip(shards, cut)]
        val = [s.part(c, s.count) for s, c in zip(shards, cut)]
    return train, val, meta
