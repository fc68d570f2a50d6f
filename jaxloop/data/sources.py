"""Data sources and the deterministic record order, in numpy only.

Imports no jax and no grain: torch_ref imports this module to replay exactly the batches jaxloop
trains on. Everything here is a pure function of the config and the data file.

Sources (`load_splits(cfg) -> Splits`), each loaded once into numpy:

- ``digits``: scikit-learn's bundled 8x8 digits (no download). x = pixels / 16 as float32 [N, 64],
  y int32 labels 0..9.
- ``text``: a UTF-8 file of characters (`data.path`). The first floor(N * (1 - val_fraction))
  characters are the training split, the rest the validation split (contiguous, so no window
  crosses the boundary). The vocabulary is the sorted set of training characters; if the validation
  split holds characters outside it, one entry ``"<unk>"`` is appended and those characters map to
  it. Training record i is the window text[i : i + context + 1] (every offset); validation record j
  is the window starting at j * context (non-overlapping, stride context). A record yields
  x = window[:-1], y = window[1:] (int32 character ids).
- ``npz``: a user file with ``x`` and ``y`` (and optionally ``x_val`` and ``y_val``). x is cast to
  float32, y must hold integer labels >= 0 (cast to int32).
- ``tokens``: token shards (`data.path`: one file, a directory of *.bin files, or a glob) in llm.c's
  format or nanoGPT's headerless uint16 .bin (jaxloop.data.shards), memory-mapped, never read whole. A
  file's split is the split word in its name (train; val, valid, validation, eval; test, never read), or
  data.train / data.val name them (jaxloop.data.shards.token_splits); without validation files, each
  training file's last val_fraction of tokens validates. Training record i is the window of context + 1 tokens
  starting at token i of its shard (every offset, as nanoGPT samples; shards in file order, no window
  crossing a shard's end); validation record j the window starting at j * context of its shard (stride
  context). x = window[:-1], y = window[1:] as int32. The vocabulary size is meta.json's vocab_size
  (beside the shards; jaxloop.prepare writes it), else model.vocab_size; a token outside it stops the
  run naming the record.

Digits and npz without x_val/y_val split by a fixed permutation (seed SPLIT_SEED, independent of
cfg.seed): perm = Generator(PCG64(SeedSequence(SPLIT_SEED))).permutation(N); the first
N - floor(N * (1 - val_fraction)) entries of perm are the validation records, the rest the training
records, each kept in file order.

Record order (`record_order`): epoch e is the permutation
Generator(PCG64(SeedSequence([cfg.seed, e]))).permutation(num_train) (for ``tokens``, whose splits
may hold billions of records, the index shuffle below with key [cfg.seed, e] instead: a permutation
computed position by position, in constant memory); it is cut into
batches_per_epoch = num_train // batch_size micro-batches of batch_size records; the remainder
(num_train % batch_size records, the tail of the permutation) is dropped for that epoch, so a batch
never spans two epochs. Global micro-batch b is batch b % batches_per_epoch of epoch
b // batches_per_epoch.

Index shuffle (`index_shuffle(key, n, positions)`): position p of a permutation of range(n), by a
4-round Feistel network with cycle walking. h = max(1, ceil(bit_length(n - 1) / 2)) bits per half;
round keys k_0..k_3 = Generator(PCG64(SeedSequence(key))).integers(0, 2**32, size=4, dtype=uint64);
one encryption of x < 4**h: L, R = x >> h, x & (2**h - 1), then for each k: L, R = R, L ^ (mix(R ^ k)
& (2**h - 1)), giving (L << h) | R, where mix is splitmix64's finalizer in uint64 arithmetic (z ^= z >> 30;
z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31). The record at position
p is encrypt(p), encrypted again while it is >= n.

Evaluation subset (`eval_records`, cfg.eval_batches > 0): the validation records at positions
0 .. eval_batches * eval_batch_size - 1 of the index shuffle with key [cfg.seed, EVAL_SUBSET_KEY] over
the validation split, sorted (file order); the whole split when that is at least its size. The same
records at every evaluation, in both loops.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jaxloop.config.run import Config, ConfigError
from jaxloop.data.identity import data_record
from jaxloop.rundir.atomic import atomic_write_text
from jaxloop.rundir.layout import VOCAB_FILE

EVAL_SUBSET_KEY = 0x6576616C
"""Second word of the evaluation subset's shuffle key ("eval" in ASCII)."""
SPLIT_SEED = 20240229
"""Seed of the fixed train/validation permutation of digits and npz (independent of cfg.seed)."""
UNK = "<unk>"
"""Vocabulary entry for validation characters that never occur in the training split."""

Batch = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- records


class Records(Protocol):
    """Random access to the records of one split."""

    def __len__(self) -> int: ...

    def get(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The records at `indices` (1-D), stacked: {"x": [n, ...], "y": [n, ...]}."""
        ...


def stack_batches(batches: Sequence[Batch]) -> Batch:
    """Dicts of arrays (records or micro-batches) stacked key by key along a new leading axis."""
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


def _as_indices(indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"record index out of range [0, {n})")
    return idx


class ArrayRecords:
    """Records that are rows of an x and a y array (digits, npz)."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} != {len(y)}")
        self.x, self.y = _readonly(x), _readonly(y)

    def __len__(self) -> int:
        return len(self.x)

    def get(self, indices: Sequence[int] | np.ndarray) -> Batch:
        idx = _as_indices(indices, len(self))
        return {"x": self.x[idx], "y": self.y[idx]}


class WindowRecords:
    """Records that are windows of context + 1 character ids, starting every `stride` ids (text)."""

    def __init__(self, ids: np.ndarray, context: int, stride: int):
        if len(ids) < context + 1:
            raise ValueError(f"{len(ids)} ids hold no window of {context + 1}")
        self.ids, self.context, self.stride = _readonly(ids.astype(np.int32)), int(context), int(stride)
        self._offsets = np.arange(self.context + 1, dtype=np.int64)

    def __len__(self) -> int:
        return (len(self.ids) - self.context - 1) // self.stride + 1

    def get(self, indices: Sequence[int] | np.ndarray) -> Batch:
        idx = _as_indices(indices, len(self))
        windows = self.ids[idx[:, None] * self.stride + self._offsets]
        return {"x": windows[:, :-1], "y": windows[:, 1:]}


class TokenWindows:
    """Records that are windows of context + 1 tokens of memory-mapped shards (the tokens source).

    A window starts every `stride` tokens of a shard and never crosses its end; shards follow one another
    in order. Picklable (grain's workers get it): the maps are opened afresh in each process. `order`
    tells the loaders to shuffle by index_shuffle (constant memory) instead of a materialised permutation.
    """

    order = "index_shuffle"

    def __init__(self, shards: Sequence[Any], context: int, stride: int, vocab_size: int, split: str):
        self.shards, self.context, self.stride = list(shards), int(context), int(stride)
        self.vocab_size, self.split = int(vocab_size), split
        counts = [max((s.count - self.context - 1) // self.stride + 1, 0) for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._files: list[int] | None = None  # each shard's descriptor, opened in the process that reads

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": None}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, indices: Sequence[int] | np.ndarray) -> Batch:
        idx = _as_indices(indices, len(self))
        if self._files is None:
            self._files = [os.open(s.path, os.O_RDONLY) for s in self.shards]
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        windows = np.empty((idx.size, self.context + 1), np.int64)
        for k in np.unique(shard):
            rows = np.nonzero(shard == k)[0]
            first = (idx[rows] - self.starts[k]) * self.stride
            # pread: a shard truncated since, or during the read, is one line, not SIGBUS
            windows[rows] = self.shards[k].windows(self._files[k], first, self.context + 1, self.split)
        if windows.size and windows.max() >= self.vocab_size:
            row = int(np.nonzero((windows >= self.vocab_size).any(axis=1))[0][0])
            s = self.shards[shard[row]]
            raise RecordError(
                f"record {int(idx[row])} of the {self.split} split holds token {int(windows[row].max())} "
                f"(in {s.path}), outside the vocabulary of {self.vocab_size} (meta.json's vocab_size, "
                "else model.vocab_size)"
            )
        windows = windows.astype(np.int32)
        return {"x": windows[:, :-1], "y": windows[:, 1:]}


class RecordError(ConfigError):
    """A malformed record or an empty split: one line naming the split, the record index, the key, what was
    found and what was expected (exit status 2, like any bad input)."""

    def __init__(self, message: str):  # one argument: it pickles (grain's worker processes raise it too)
        ValueError.__init__(self, message)
        self.field_path, self.value, self.allowed = "records", None, message


Spec = tuple[tuple[str, tuple[int, ...], str], ...]
"""A record's structure: (key, shape, dtype) of each of its arrays, in key order."""

RECORDS_CHECKED_WHOLE = 200_000
"""An in-memory split (a list or tuple) of at most this many records is checked record by record before
anything is written (0.3-1.5 s per 200,000 records of two arrays on a loaded 2-core machine); a larger
or lazy one (a grain MapDataset, say) its first FIRST_RECORDS_CHECKED, and every record when batched."""
FIRST_RECORDS_CHECKED = 16


def record_spec(record: Any) -> Spec | None:
    """(key, shape, dtype) of each value of a dict record, sorted by key; None if it is not a non-empty dict."""
    if not isinstance(record, dict) or not record:
        return None
    return tuple(sorted((str(key), *_shape_dtype(value)) for key, value in record.items()))


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(value, (np.ndarray, np.generic)):
        return value.shape, value.dtype.str
    a = np.asarray(value)
    return a.shape, a.dtype.str


def _spec_text(spec: Spec) -> dict[str, str]:
    return {key: f"shape {shape} {np.dtype(dtype).name}" for key, shape, dtype in spec}


def record_error(split: str, index: int, record: Any, expected: Spec, why: str) -> RecordError:
    """The one line saying how record `index` of `split` differs from `expected` (`why`: whose structure
    that is, e.g. "as 99 of the 100 records checked have")."""
    where = f"record {index} of the {split} split"
    found = record_spec(record)
    if found is None:
        return RecordError(
            f"{where} is {type(record).__name__} {_short(record)}, expected a non-empty dict of arrays ({why})"
        )
    have, want = _spec_text(found), _spec_text(expected)
    if set(have) != set(want):
        return RecordError(f"{where} has keys {sorted(have)}, expected {sorted(want)} ({why})")
    key = next(k for k in sorted(want) if have[k] != want[k])
    return RecordError(f"{where}: key {key!r} has {have[key]}, expected {want[key]} ({why})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class SequenceRecords:
    """Records from any random-access sequence of dicts of arrays (a list, a grain MapDataset, ...).

    Every record must have the same keys, shapes and dtypes: checked when the split is made (every record
    of an in-memory split up to RECORDS_CHECKED_WHOLE records, else the first FIRST_RECORDS_CHECKED; the
    structure most of them share is the expected one, so a bad record 0 is named as such) and for every
    record `get` stacks, so that a bad record stops the run with a RecordError naming it (`split` names
    the split) rather than numpy's error or a silent promotion.
    """

    def __init__(self, seq: Any, split: str = "records"):
        if not hasattr(seq, "__getitem__") or not hasattr(seq, "__len__"):
            raise RecordError(
                f"the {split} split must support len() and [i] (a sequence of dicts of arrays), "
                f"got {type(seq).__name__}"
            )
        if len(seq) == 0:
            raise RecordError(f"the {split} split holds no records: give it at least one")
        self.seq, self.split = seq, split
        whole = isinstance(seq, (list, tuple)) and len(seq) <= RECORDS_CHECKED_WHOLE
        checked = len(seq) if whole else min(len(seq), FIRST_RECORDS_CHECKED)
        specs = [record_spec(seq[i]) for i in range(checked)]
        counts = Counter(spec for spec in specs if spec is not None)
        if not counts:
            raise RecordError(
                f"record 0 of the {split} split is {type(seq[0]).__name__} {_short(seq[0])}, expected "
                "a non-empty dict of arrays"
            )
        self.spec, most = counts.most_common(1)[0]  # ties: the first record's
        self.why = f"as {most} of the {checked} records checked have" if checked > 1 else "as record 0 has"
        bad = next((i for i, spec in enumerate(specs) if spec != self.spec), None)
        if bad is not None:
            raise record_error(split, bad, seq[bad], self.spec, self.why)

    def check(self, indices: Any) -> list[Any]:
        """The records at `indices`, each checked against the split's structure (RecordError if one differs)."""
        records = []
        for i in indices:
            record = self.seq[int(i)]
            if record_spec(record) != self.spec:
                raise record_error(self.split, int(i), record, self.spec, self.why)
            records.append(record)
        return records

    def __len__(self) -> int:
        return len(self.seq)

    def get(self, indices: Sequence[int] | np.ndarray) -> Batch:
        idx = _as_indices(indices, len(self))
        return stack_batches(self.check(idx))


def as_records(source: Any, split: str = "records") -> Records:
    """`source` itself if it has `get(indices)` (Records), else SequenceRecords(source, split); an empty
    source is a RecordError naming the split."""
    if hasattr(source, "get") and hasattr(source, "__len__"):
        if len(source) == 0:
            raise RecordError(f"the {split} split holds no records: give it at least one")
        return source
    return SequenceRecords(source, split)


@dataclass(frozen=True, eq=False)
class Splits:
    """The training and validation records of a run's source.

    num_classes: label count (digits, npz: max label + 1) or vocabulary size (text).
    example_x: one input, shape [1, ...], with the dtype fed to the model (for initialisation); None for a
    Task's records with no "x" (a Task's state is initialised from a whole record).
    vocab: the text vocabulary (id -> character, "<unk>" possibly last), None for other sources.
    record: the files read, their splits and fingerprints (jaxloop.data.identity; metadata.json's "data"),
    None for the bundled digits and records of one's own.
    """

    source: str
    train: Records
    val: Records
    num_classes: int
    example_x: np.ndarray | None
    vocab: tuple[str, ...] | None = None
    record: dict[str, Any] | None = None

    @property
    def num_train(self) -> int:
        return len(self.train)

    @property
    def num_val(self) -> int:
        return len(self.val)


# ----------------------------------------------------------------------------- loading


def load_splits(cfg: Config) -> Splits:
    """Load cfg.data.source into numpy and split it; ConfigError on bad input (see module doc).

    Also checks that batch_size fits in the training split (a micro-batch never spans epochs) and
    that a non-zero model.vocab_size covers every label.
    """
    d = cfg.data
    if d.source == "digits":
        splits = _load_digits(d.val_fraction)
    elif d.source == "text":
        splits = _load_text(_file_key(d.path), d.val_fraction, cfg.model.context)
    elif d.source == "npz":
        splits = _load_npz(_file_key(d.path), d.val_fraction)
    elif d.source == "tokens":
        splits = _load_tokens(d.path, d.val_fraction, cfg.model.context, cfg.model.vocab_size, d.train, d.val)
    else:
        raise ConfigError("data.source", d.source, "one of digits, text, npz, tokens")
    if cfg.batch_size > splits.num_train:
        raise ConfigError(
            "batch_size",
            cfg.batch_size,
            f"at most the {splits.num_train} records of the training split ({d.source})",
        )
    if cfg.model.vocab_size and cfg.model.vocab_size < splits.num_classes:
        raise ConfigError(
            "model.vocab_size",
            cfg.model.vocab_size,
            f"0 (from the data) or at least the data's {splits.num_classes} classes",
        )
    return splits


def _file_key(path: str) -> tuple[str, int, int]:
    """(absolute path, size, mtime_ns): a cache key that changes when the file does."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError("data.path", path, f"an existing readable file ({e.strerror})") from None
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def _num_train(n: int, val_fraction: float) -> int:
    return int(math.floor(n * (1.0 - val_fraction)))


def _fixed_split(n: int, val_fraction: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) record indices of a fixed, seed-independent permutation, each in file order."""
    n_train = _num_train(n, val_fraction)
    if n_train < 1 or n_train >= n:
        raise ConfigError(
            "data.val_fraction",
            val_fraction,
            f"a fraction leaving at least one training and one validation record of the {n} in {what}",
        )
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence(SPLIT_SEED))).permutation(n)
    n_val = n - n_train
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def digits_file() -> str:
    """scikit-learn's bundled digits (digits.csv.gz: 1797 rows of 64 pixel values 0..16 and the label),
    located without importing sklearn: its import costs ~1.2 s of a digits run's start-up, the file
    0.03 s to read. sklearn.datasets.load_digits() reads the same file the same way (np.loadtxt)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.source", "digits", "scikit-learn installed (its bundled digits are the data)")
    return os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")


@functools.lru_cache(maxsize=2)
def _load_digits(val_fraction: float) -> Splits:
    data = np.loadtxt(digits_file(), delimiter=",")  # a .gz path is decompressed by numpy
    x = (data[:, :-1].astype(np.float32) / np.float32(16.0)).astype(np.float32)
    y = data[:, -1].astype(np.int32)
    tr, va = _fixed_split(len(x), val_fraction, "digits")
    return Splits(
        source="digits",
        train=ArrayRecords(x[tr], y[tr]),
        val=ArrayRecords(x[va], y[va]),
        num_classes=10,
        example_x=np.zeros((1, x.shape[1]), np.float32),
    )


@functools.lru_cache(maxsize=2)
def _load_text(key: tuple[str, int, int], val_fraction: float, context: int) -> Splits:
    path = key[0]
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError("data.path", path, f"a readable text file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("data.path", path, f"a UTF-8 text file (invalid UTF-8 at byte {e.start})") from None
    n = len(text)
    n_train = _num_train(n, val_fraction)
    window = context + 1
    if n_train < window:
        raise ConfigError(
            "data.path",
            path,
            f"a text whose training split (first {1 - val_fraction:g} of its characters) holds at least "
            f"model.context + 1 = {window} characters (it holds {n_train} of {n})",
        )
    if n - n_train < window:
        raise ConfigError(
            "data.val_fraction",
            val_fraction,
            f"a fraction whose validation split holds at least model.context + 1 = {window} characters "
            f"(it holds {n - n_train} of {n} in {path})",
        )
    train_text, val_text = text[:n_train], text[n_train:]
    chars = sorted(set(train_text))
    unseen = set(val_text) - set(chars)
    vocab = tuple(chars) + ((UNK,) if unseen else ())
    lut = {c: i for i, c in enumerate(chars)}
    unk_id = len(chars)
    train_ids = _encode(train_text, lut, None)
    val_ids = _encode(val_text, lut, unk_id)
    return Splits(
        source="text",
        train=WindowRecords(train_ids, context, stride=1),
        val=WindowRecords(val_ids, context, stride=context),
        num_classes=len(vocab),
        example_x=np.zeros((1, context), np.int32),
        vocab=vocab,
        record=data_record("text", path, [path]),
    )


def _encode(text: str, lut: dict[str, int], unk_id: int | None) -> np.ndarray:
    """Character ids of `text` through a code-point lookup table; unknown characters -> unk_id."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.full(int(codes.max()) + 1 if codes.size else 1, -1, np.int64)
    for c, i in lut.items():
        if ord(c) < len(table):
            table[ord(c)] = i
    ids = table[codes]
    if unk_id is not None:
        ids[ids < 0] = unk_id
    if (ids < 0).any():  # cannot happen for the training split, which defines the vocabulary
        raise AssertionError("character outside the vocabulary")
    return ids.astype(np.int32)


def encode(text: str, vocab: Sequence[str]) -> np.ndarray:
    """Character ids of `text` under `vocab` (characters outside it map to "<unk>" if present)."""
    lut = {c: i for i, c in enumerate(vocab) if c != UNK}
    unk_id = list(vocab).index(UNK) if UNK in vocab else None
    ids = [lut.get(c, unk_id) for c in text]
    if any(i is None for i in ids):
        missing = sorted({c for c, i in zip(text, ids) if i is None})
        raise ValueError(f"characters outside the vocabulary: {missing!r}")
    return np.asarray(ids, np.int32)


def decode(ids: Sequence[int] | np.ndarray, vocab: Sequence[str]) -> str:
    """The text of character ids under `vocab` ("<unk>" decodes to U+FFFD)."""
    return "".join("\ufffd" if vocab[int(i)] == UNK else vocab[int(i)] for i in np.asarray(ids).ravel())


@functools.lru_cache(maxsize=2)
def _load_npz(key: tuple[str, int, int], val_fraction: float) -> Splits:
    path = key[0]
    field = "data.path"
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - any unreadable file is bad input
        raise ConfigError(field, path, f"a readable .npz archive of x and y arrays ({type(e).__name__}: {e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ConfigError(field, path, "an .npz archive (np.savez) of x and y arrays, not a single .npy array")
    try:
        keys = set(z.files)
        arrays = {k: z[k] for k in ("x", "y", "x_val", "y_val") if k in keys}
    except Exception as e:  # noqa: BLE001 - a corrupt member
        raise ConfigError(field, path, f"a readable .npz archive of x and y arrays ({type(e).__name__}: {e})") from None
    finally:
        z.close()
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ConfigError(
            field, path, f"an .npz holding arrays x and y (missing {', '.join(missing)}; has {sorted(keys)})"
        )
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise ConfigError(field, path, "an .npz holding both x_val and y_val, or neither")

    def check(xk: str, yk: str) -> tuple[np.ndarray, np.ndarray]:
        x, y = arrays[xk], arrays[yk]
        if x.ndim != 2:
            fix = (
                f"{xk}[:, None] if each record is one number"
                if x.ndim == 1
                else f"flatten each record's features: {xk}.reshape(len({xk}), -1)"
            )
            raise ConfigError(
                field, path, f"{xk} of shape (records, features), 2 dimensions (got shape {x.shape}; {fix})"
            )
        if y.ndim != 1:
            raise ConfigError(
                field,
                path,
                f"{yk} of shape (records,), one integer label per record (got shape "
                f"{y.shape}; {yk}.reshape(-1) gives it if each record has one label)",
            )
        if len(x) != len(y):
            raise ConfigError(field, path, f"{xk} and {yk} with the same number of records (got {len(x)} and {len(y)})")
        if len(x) == 0:
            raise ConfigError(field, path, f"at least one record in {xk} and {yk}")
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_) or np.issubdtype(x.dtype, np.complexfloating):
            raise ConfigError(field, path, f"a real numeric {xk} (got dtype {x.dtype})")
        if not np.issubdtype(y.dtype, np.integer):
            raise ConfigError(field, path, f"integer class labels in {yk} (got dtype {y.dtype})")
        if y.min() < 0 or y.max() > np.iinfo(np.int32).max:
            raise ConfigError(field, path, f"labels in {yk} in [0, 2**31) (got min {y.min()}, max {y.max()})")
        x32 = x.astype(np.float32)
        if not np.isfinite(x32).all():
            raise ConfigError(field, path, f"finite float32 values in {xk}")
        return x32, y.astype(np.int32)

    x, y = check("x", "y")
    if "x_val" in arrays:
        x_val, y_val = check("x_val", "y_val")
        if x_val.shape[1:] != x.shape[1:] or y_val.shape[1:] != y.shape[1:]:
            raise ConfigError(
                field,
                path,
                f"x_val/y_val records shaped like x/y ({x.shape[1:]}/{y.shape[1:]}; "
                f"got {x_val.shape[1:]}/{y_val.shape[1:]})",
            )
        x_train, y_train = x, y
        rows_train, rows_val = np.arange(len(x)), np.arange(len(x_val))
    else:
        rows_train, rows_val = _fixed_split(len(x), val_fraction, path)
        x_train, y_train, x_val, y_val = x[rows_train], y[rows_train], x[rows_val], y[rows_val]
    num_classes = _check_labels(path, y_train, y_val, rows_train, rows_val, "y_val" in arrays)
    return Splits(
        source="npz",
        train=ArrayRecords(x_train, y_train),
        val=ArrayRecords(x_val, y_val),
        num_classes=num_classes,
        example_x=np.zeros((1,) + x.shape[1:], np.float32),
        record=data_record("npz", path, [path]),
    )


def _check_labels(
    path: str, y_train: np.ndarray, y_val: np.ndarray, rows_train: np.ndarray, rows_val: np.ndarray, own_val: bool
) -> int:
    """The class count of an npz's labels (1 + the largest training label), or a ConfigError naming the split,
    record index and label of the first record that breaks the rules (docs/data.md): the training labels are
    the class indices 0 .. num_classes - 1, every one of them present (a label beyond a class no record has, a
    1000 among labels 0..3, is not a class index), and every validation label is a class the training split has
    (one seen only in validation cannot be learned)."""
    num_classes = int(y_train.max()) + 1
    present = np.zeros(num_classes, bool)
    present[y_train] = True

    def where(split: str, i: int, rows: np.ndarray, key: str) -> str:
        return f"record {i} of the {split} split ({key}[{int(rows[i])}] in {path})"

    if not present.all():
        missing = int(np.flatnonzero(~present)[0])
        i = int(np.flatnonzero(y_train > missing)[0])
        seen = f"0..{missing - 1}" if missing else "none below it"
        raise ConfigError(
            "data.path",
            path,
            f"class indices as labels: {where('train', i, rows_train, 'y')} has label "
            f"{int(y_train[i])}, but no training record has label {missing} (labels seen from 0: "
            f"{seen}); labels are 0 .. num_classes - 1, each with training records",
        )
    unseen = np.flatnonzero(y_val >= num_classes)
    if len(unseen):
        i = int(unseen[0])
        raise ConfigError(
            "data.path",
            path,
            f"validation labels the training split has: "
            f"{where('val', i, rows_val, 'y_val' if own_val else 'y')} has label {int(y_val[i])}, "
            f"a class seen only in validation (training labels are 0..{num_classes - 1})",
        )
    return num_classes


def _load_tokens(
    path: str, val_fraction: float, context: int, vocab_size: int, train_glob: str = "", val_glob: str = ""
) -> Splits:
    from jaxloop.data.shards import META_FILE, token_splits

    assigned = token_splits(path, val_fraction, train_glob, val_glob)
    train, val, meta = assigned.train, assigned.val, assigned.meta
    vocab = int(meta["vocab_size"]) if meta is not None else vocab_size
    if not vocab:
        raise ConfigError(
            "model.vocab_size",
            vocab_size,
            f"the token shards' vocabulary size (they have no {META_FILE} "
            "beside them to say it; e.g. 50257 for GPT-2's tokenizer)",
        )
    splits = Splits(
        source="tokens",
        train=TokenWindows(train, context, 1, vocab, "train"),
        val=TokenWindows(val, context, context, vocab, "val"),
        num_classes=vocab,
        example_x=np.zeros((1, context), np.int32),
        record=data_record("tokens", path or train_glob, [s.path for s in train + val], assigned.record()),
    )
    for name, records, shards in (("training", splits.train, train), ("validation", splits.val, val)):
        if len(records) == 0:
            raise ConfigError(
                "data.path",
                path,
                f"token shards whose {name} split holds a window of model.context + 1 "
                f"= {context + 1} tokens (its longest shard holds {max(s.count for s in shards)})",
            )
    return splits


# ----------------------------------------------------------------------------- vocabulary file


def write_vocab(run_dir: str, splits: Splits) -> str | None:
    """Save a text source's vocabulary as run_dir/vocab.json (atomically); returns its path.

    Does nothing (returns None) for sources without a vocabulary.
    """
    if splits.vocab is None:
        return None
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, VOCAB_FILE)
    atomic_write_text(
        path, json.dumps({"vocab": list(splits.vocab), "unk": UNK if UNK in splits.vocab else None}, ensure_ascii=False)
    )
    return path


def read_vocab(run_dir: str) -> tuple[str, ...] | None:
    """The vocabulary saved by write_vocab (id -> character), or None if the run has none."""
    path = os.path.join(run_dir, VOCAB_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return tuple(json.load(f)["vocab"])


# ----------------------------------------------------------------------------- record order


def batches_per_epoch(cfg: Config, num_train: int) -> int:
    """Micro-batches per epoch: num_train // batch_size (the remainder is dropped each epoch)."""
    return batches_in_epoch(cfg.batch_size, num_train)


def batches_in_epoch(batch_size: int, num_train: int) -> int:
    if batch_size < 1 or batch_size > num_train:
        raise ConfigError("batch_size", batch_size, f"an integer in [1, {num_train}] (the training split's records)")
    return num_train // batch_size


@functools.lru_cache(maxsize=4)
def _cached_permutation(seed: int, epoch: int, num_train: int) -> np.ndarray:
    return _readonly(epoch_permutation(seed, epoch, num_train))


def epoch_permutation(seed: int, epoch: int, num_train: int) -> np.ndarray:
    """The order of the training records in epoch `epoch`: a permutation of range(num_train)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch)])))
    return rng.permutation(num_train)


SHUFFLE_ROUNDS = 4


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise over uint64 (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=16)
def _shuffle_keys(key: tuple[int, ...]) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))
    return rng.integers(0, 2**32, size=SHUFFLE_ROUNDS, dtype=np.uint64)


def index_shuffle(key: Sequence[int], n: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """The records at `positions` of a permutation of range(n) drawn from `key` (module doc): each computed on
    its own, so no permutation of n is ever held (n may be billions)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    half = max(1, -(-int(n - 1).bit_length() // 2))
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    keys = _shuffle_keys(tuple(int(k) for k in key))

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << shift) | right

    y = encrypt(np.asarray(positions, dtype=np.uint64).reshape(-1))
    out = y >= np.uint64(n)
    while out.any():  # cycle walking: the permutation of [0, 4**half) restricted to [0, n)
        y[out] = encrypt(y[out])
        out = y >= np.uint64(n)
    return y.astype(np.int64)


def eval_records(seed: int, num_val: int, batches: int, batch_size: int) -> np.ndarray | None:
    """The validation records evaluated (module doc: evaluation subset), sorted; None for the whole split
    (batches 0, or a subset at least as large as the split)."""
    count = int(batches) * int(batch_size)
    if batches <= 0 or count >= num_val:
        return None
    return np.sort(index_shuffle((int(seed), EVAL_SUBSET_KEY), num_val, np.arange(count)))


def record_order(cfg: Config, num_train: int, start: int, count: int, order: str = "permutation") -> np.ndarray:
    """Global record indices of micro-batches start .. start + count - 1: int64 [count, batch_size].

    Micro-batch b (the loader's position; an update consumes optim.accum_steps of them) is batch
    b % batches_per_epoch of epoch b // batches_per_epoch, and epoch e's records are
    epoch_permutation(cfg.seed, e, num_train) (order "index_shuffle": index_shuffle((cfg.seed, e), ...)) cut
    into batches of batch_size, remainder dropped.
    """
    return _record_order(cfg.seed, cfg.batch_size, num_train, start, count, order)


def _record_order(
    seed: int, batch_size: int, num_train: int, start: int, count: int, order: str = "permutation"
) -> np.ndarray:
    if start < 0 or count < 0:
        raise ValueError(f"start and count must be >= 0, got {start}, {count}")
    bpe = batches_in_epoch(batch_size, num_train)
    out = np.empty((count, batch_size), np.int64)
    for row, b in enumerate(range(start, start + count)):
        epoch, k = divmod(b, bpe)
        if order == "index_shuffle":
            out[row] = index_shuffle((seed, epoch), num_train, np.arange(k * batch_size, (k + 1) * batch_size))
        else:
            out[row] = _cached_permutation(seed, epoch, num_train)[k * batch_size : (k + 1) * batch_size]
    return out


def order_of(records: Any) -> str:
    """How a training split is shuffled: "index_shuffle" for records that say so (token windows), else
    "permutation"."""
    return getattr(records, "order", "permutation")


def shard_slice(batch_size: int, process_index: int, process_count: int) -> slice:
    """The rows of a global micro-batch that process `process_index` of `process_count` gets."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if batch_size % process_count:
        raise ConfigError("batch_size", batch_size, f"a multiple of the process count ({process_count})")
    per = batch_size // process_count
    return slice(process_index * per, (process_index + 1) * per)


class MicroBatchGather:
    """micro-batch index -> this process's shard of that micro-batch, as a numpy dict.

    Picklable and jax-free: it is what grain's worker processes run (and what torch_ref can call).
    `transform(batch) -> batch`, if given, runs after the gather (in the worker); it must be
    deterministic for batches to stay the same across worker counts.
    """

    def __init__(
        self,
        records: Records,
        seed: int,
        batch_size: int,
        process_index: int = 0,
        process_count: int = 1,
        transform: Callable[[Batch], Batch] | None = None,
    ):
        self.records, self.seed, self.batch_size = records, int(seed), int(batch_size)
        self.num_train = len(records)
        batches_in_epoch(self.batch_size, self.num_train)
        self.rows = shard_slice(self.batch_size, process_index, process_count)
        self.transform = transform
        self.order = order_of(records)

    def indices(self, b: int) -> np.ndarray:
        return _record_order(self.seed, self.batch_size, self.num_train, int(b), 1, self.order)[0, self.rows]

    def __call__(self, b: int) -> Batch:
        batch = self.records.get(self.indices(b))
        return self.transform(batch) if self.transform is not None else batch

    def chunk(self, start: int, count: int) -> Batch:
        """Micro-batches start .. start + count - 1 stacked along a new leading axis, read in one gather
        (one fancy index over count x batch records instead of count gathers and a stack)."""
        if self.transform is not None:  # the transform sees one micro-batch at a time, as in __call__
            return stack_batches([self(b) for b in range(start, start + count)])
        idx = _record_order(self.seed, self.batch_size, self.num_train, start, count, self.order)[:, self.rows]
        batch = self.records.get(idx.reshape(-1))
        return {k: v.reshape(idx.shape + v.shape[1:]) for k, v in batch.items()}


class ChunkGather:
    """chunk index i -> micro-batches stacked: chunk 0 holds `first` of them from `start`, every later
    chunk `size`. Picklable (grain's worker processes run it), like MicroBatchGather."""

    def __init__(self, gather: MicroBatchGather, start: int, size: int, first: int):
        if size < 1 or first < 1:
            raise ValueError(f"chunk sizes must be >= 1, got size {size}, first {first}")
        self.gather, self.start, self.size, self.first = gather, int(start), int(size), int(first)

    def __call__(self, i: int) -> Batch:
        if i == 0:
            return self.gather.chunk(self.start, self.first)
        return self.gather.chunk(self.start + self.first + (i - 1) * self.size, self.size)
