"""`python -m jaxloop.prepare`: text files in, llm.c token shards out, for `--data.source tokens`.

    python -m jaxloop.prepare corpus/*.txt --out shards/                  # plain bytes (vocabulary 256)
    python -m jaxloop.prepare corpus/*.txt --out shards/ --vocab 4096     # a byte-level BPE trained on it
    python -m jaxloop.prepare corpus/*.txt --out shards/ --tokenizer tokenizer.json   # or a HF model directory

The inputs (files or globs, in the order given) are read as one stream, PIECE_BYTES at a time; the last
--val_fraction of its bytes, from the first line there that starts with a non-space character, is the validation
split, the rest the training split. Text is encoded in pieces of about 64 KiB cut before such lines (so that a
byte-level BPE's pre-tokenizer sees the same words as in the whole text), else, in text without them, after a
newline, else at a UTF-8 character boundary: memory stays bounded on any input. Pieces are encoded a batch at a
time on every core (Hugging Face `tokenizers`' encode_batch), without special tokens; nothing is downloaded. An
end-of-text token (<|endoftext|>; 256 in plain bytes) goes between files, and between the documents of a file
where --doc_separator is given. One pass over the text (two with --vocab: the BPE is trained first), progress
on a terminal from the start. Out come NAME_train_000000.bin, ... and NAME_val_000000.bin, ... in llm.c's format (uint16
tokens for a vocabulary of at most 65536, else uint32), --shard_tokens tokens each, the tokenizer as
tokenizer.json (BPE and --tokenizer), and meta.json (vocab_size, tokenizer, eot, dtype, counts), written last: a
directory with meta.json is complete. Bad input: one line, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxloop.config.run import ConfigError
from jaxloop.data.shards import META_FILE

PIECE_BYTES = 1 << 16
"""Text read and encoded at a time (cut before a line that starts with a non-space character where it can): small,
because HF tokenizers' Encoding of a piece takes some 100-350 bytes a token (measured: ~25 MB for 64 KiB of text
under a 300-token BPE)."""
TOKENIZER_FILE = "tokenizer.json"
BATCH_PIECES = 8
"""At most this many pieces are encoded at once (encode_batch: one per core), bounding memory on many cores."""


def input_files(patterns: list[str]) -> list[str]:
    """Each pattern's files (a glob's matches sorted), in the order given; ConfigError if one names none."""
    files: list[str] = []
    for pattern in patterns:
        found = (
            sorted(f for f in glob.glob(pattern) if os.path.isfile(f))
            if glob.has_magic(pattern)
            else ([pattern] if os.path.isfile(pattern) else [])
        )
        if not found:
            raise ConfigError("inputs", pattern, "an existing text file or a glob matching some")
        files += found
    if sum(os.path.getsize(f) for f in files) == 0:
        raise ConfigError("inputs", patterns, "text files that are not all empty")
    return files


@dataclass(frozen=True)
class Piece:
    """Bytes of the inputs' stream encoded at once; doc_start: they begin a file or a --doc_separator document."""

    split: str
    data: bytes
    doc_start: bool


_LINE_START = re.compile(rb"\n(?=[^\s])")
"""Where a line that starts with a non-space character begins (the position after the match's newline)."""


def _utf8_start(buf: bytes, p: int, back: bool) -> int:
    """The nearest UTF-8 character start at or before (back) / after p; p itself when none is within 3 bytes."""
    step = -1 if back else 1
    for q in range(p, p + 4 * step, step):
        if 0 < q < len(buf) and buf[q] & 0xC0 != 0x80:
            return q
    return p


def _cut_back(buf: bytes) -> int:
    """Where to end a full piece (0 < cut <= len(buf)): before its last line that starts with a non-space character,
    else after its last newline, else at a UTF-8 character boundary (any byte: a line longer than a piece)."""
    starts = [m.end() for m in _LINE_START.finditer(buf)]
    if starts:
        return starts[-1]
    newline = buf.rfind(b"\n", 0, len(buf) - 1)
    if newline >= 0:
        return newline + 1
    return _utf8_start(buf, len(buf) - 1, back=True) or len(buf)


def _cut_at(buf: bytes, at: int) -> int:
    """Where the validation split starts in buf, at or after `at`: the first line there that starts with a non-space
    character, else the first line break, else a UTF-8 character boundary (len(buf) when buf ends first)."""
    if at <= 0:
        return 0
    m = _LINE_START.search(buf, at - 1)
    if m is not None:
        return m.end()
    newline = buf.find(b"\n", at - 1)
    if 0 <= newline < len(buf) - 1:
        return newline + 1
    return _utf8_start(buf, at, back=False) if at < len(buf) else len(buf)


class _Cutter:
    """Cuts documents' bytes, fed in blocks, into Pieces of about piece_bytes (memory: two pieces at most)."""

    def __init__(self, val_from: int, piece_bytes: int):
        self.val_from, self.piece_bytes = val_from, piece_bytes
        self.offset, self.split, self.pending, self.doc_start = 0, "train", b"", True

    def feed(self, data: bytes, final: bool) -> Iterator[Piece]:
        """Pieces of pending + data; final: the document ends after data (everything pending goes out)."""
        self.pending += data
        while self.pending:
            buf = self.pending
            if self.split == "train" and self.offset + len(buf) > self.val_from:
                at = self.val_from - self.offset
                if not final and _LINE_START.search(buf, max(at - 1, 0)) is None and len(buf) - at < self.piece_bytes:
                    return  # no line start after the cut yet: read on (a piece's worth at most)
                cut = _cut_at(buf, at)
                if cut:
                    yield self._out(cut)
                self.split = "val"
                continue
            if not final and len(buf) < self.piece_bytes:
                return
            yield self._out(len(buf) if final else _cut_back(buf))

    def skip(self, n: int) -> None:
        """n bytes of the stream dropped (a --doc_separator); a document starts after them."""
        self.offset += n
        self.doc_start = True

    def _out(self, cut: int) -> Piece:
        piece = Piece(self.split, self.pending[:cut], self.doc_start)
        self.offset += cut
        self.pending, self.doc_start = self.pending[cut:], False
        return piece


def pieces(files: list[str], val_from: int, piece_bytes: int | None = None, separator: bytes = b"") -> Iterator[Piece]:
    """The inputs' stream in Pieces, read piece_bytes (PIECE_BYTES) at a time: "val" from byte `val_from` on (from
    the first line there that starts with a non-space character, see _cut_at), "train" before. A piece ends at a
    file's end, before a `separator` (whose bytes are dropped), or, once it holds piece_bytes, before its last line
    that starts with a non-space character (else at its last newline, else at a UTF-8 character boundary)."""
    piece_bytes = piece_bytes or PIECE_BYTES
    cutter = _Cutter(val_from, piece_bytes)
    keep = max(len(separator) - 1, 0)
    for path in files:
        cutter.doc_start = True
        with open(path, "rb") as f:
            carry = b""
            while True:
                chunk = f.read(piece_bytes)
                data, eof = carry + chunk, not chunk
                if separator:
                    *docs, data = data.split(separator)
                    for doc in docs:
                        yield from cutter.feed(doc, final=True)
                        cutter.skip(len(separator))
                    cut = len(data) if eof else max(len(data) - keep, 0)  # a separator may begin in the tail
                    data, carry = data[:cut], data[cut:]
                yield from cutter.feed(data, final=eof)
                if eof:
                    break


def _texts(files: list[str], val_from: int, separator: bytes, progress: Any) -> Iterator[str]:
    """The training split's pieces as text (the BPE trainer's input), counted on `progress`."""
    for piece in pieces(files, val_from, separator=separator):
        if piece.split == "train":
            progress.update(len(piece.data))
            yield _decode(piece)


def _decode(piece: Piece) -> str:
    try:
        return piece.data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "inputs",
            "",
            f"UTF-8 text for a tokenizer (invalid UTF-8 near byte {e.start} of a piece "
            f"of {piece.split} text); plain bytes (no --vocab or --tokenizer) take any file",
        ) from None


def read_tokenizer(path: str) -> Any:
    """A Hugging Face `tokenizers.Tokenizer` from `path`: a tokenizer.json file, or a model directory holding
    tokenizer.json, or vocab.json + merges.txt (a byte-level BPE, GPT-2's: models.BPE.from_file with GPT-2's
    byte-level pre-tokenizer and decoder). ValueError saying what `path` lacks."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if os.path.isdir(path):
        files = {name: os.path.join(path, name) for name in ("tokenizer.json", "vocab.json", "merges.txt")}
        if os.path.isfile(files["tokenizer.json"]):
            path = files["tokenizer.json"]
        elif os.path.isfile(files["vocab.json"]) and os.path.isfile(files["merges.txt"]):
            try:
                tok = Tokenizer(models.BPE.from_file(files["vocab.json"], files["merges.txt"]))
            except Exception as e:  # noqa: BLE001 - any unreadable vocabulary is bad input
                raise ValueError(f"a vocab.json and merges.txt that HF tokenizers reads ({_short(e)})") from None
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            return tok
        else:
            raise ValueError(
                "a Hugging Face model directory holding tokenizer.json, or vocab.json and merges.txt "
                "(this one holds neither)"
            )
    elif not os.path.isfile(path):
        raise ValueError("an existing tokenizer.json file or a Hugging Face model directory")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer file is bad input
        raise ValueError(f"a readable tokenizer.json of HF tokenizers ({_short(e)})") from None


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:120]


EOT = "<|endoftext|>"
"""The end-of-text token between files and documents (GPT-2's; id 256 in plain bytes, a vocabulary of 257)."""


def load_tokenizer(args: argparse.Namespace, files: list[str], val_from: int, separator: bytes, eot: bool) -> Any:
    """The HF tokenizer (None for plain bytes): --tokenizer's (read_tokenizer; EOT added as a special token when
    `eot` and it lacks one), or a byte-level BPE of --vocab tokens (EOT among them when `eot`) trained on the
    training split, with a progress bar."""
    if args.tokenizer:
        try:
            tok = read_tokenizer(args.tokenizer)
        except ValueError as e:
            raise ConfigError("--tokenizer", args.tokenizer, str(e)) from None
        if eot and tok.token_to_id(EOT) is None:
            tok.add_special_tokens([EOT])
        return tok
    if args.vocab:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=args.vocab,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[EOT] if eot else [],
            show_progress=False,
        )
        with _bar(args, val_from, "BPE training, pass 1 of 2") as bar:
            tok.train_from_iterator(_texts(files, val_from, separator, bar), trainer)
        return tok
    return None


def _bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    """A tqdm bar over `total` input bytes on stderr (on a terminal only; none with --no_progress)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=args.no_progress or None)


def encode_batch(tokenizer: Any, batch: list[Piece], eot: int | None, first: bool) -> list[np.ndarray]:
    """The pieces' token ids (their bytes, or the tokenizer's ids without special tokens, encoded on every core by
    encode_batch_fast: no offsets), each after an `eot` where it starts a document (but the stream's first, when `first`)."""
    if tokenizer is None:
        ids = [np.frombuffer(p.data, np.uint8).astype(np.uint32) for p in batch]
    else:
        ids = [
            np.asarray(e.ids, np.uint32)
            for e in tokenizer.encode_batch_fast([_decode(p) for p in batch], add_special_tokens=False)
        ]
    out = []
    for i, (piece, tokens) in enumerate(zip(batch, ids)):
        if eot is not None and piece.doc_start and not (first and i == 0):
            tokens = np.concatenate([np.asarray([eot], np.uint32), tokens])
        out.append(tokens)
    return out


class ShardWriter:
    """Tokens of one split into NAME_SPLIT_000000.bin, ... of `per_shard` tokens each (llm.c's format), written as they
    come: the header's count is filled in when a shard is full or the split ends (memory: one call's tokens)."""

    def __init__(self, out: str, name: str, split: str, dtype: str, per_shard: int):
        from jaxloop.data.shards import LLMC_FORMATS

        self.out, self.name, self.split, self.per_shard = out, name, split, per_shard
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.magic = next(m for m, (_, d) in LLMC_FORMATS.items() if d == np.dtype(dtype))
        self.version = LLMC_FORMATS[self.magic][0]
        self.tokens, self.in_shard = 0, 0
        self.file: Any = None
        self.files: list[str] = []

    def add(self, tokens: np.ndarray) -> None:
        self.tokens += tokens.size
        while tokens.size:
            if self.file is None:
                self.file = open(self._path() + ".tmp", "wb")  # noqa: SIM115 - closed by _finish
                self.file.write(self._header(0))
            take = min(self.per_shard - self.in_shard, tokens.size)
            self.file.write(tokens[:take].astype(self.dtype).tobytes())
            self.in_shard += take
            tokens = tokens[take:]
            if self.in_shard == self.per_shard:
                self._finish()

    def close(self) -> None:
        if self.file is not None:
            self._finish()

    def _path(self) -> str:
        return os.path.join(self.out, f"{self.name}_{self.split}_{len(self.files):06d}.bin")

    def _header(self, count: int) -> bytes:
        from jaxloop.data.shards import HEADER_INTS

        header = np.zeros(HEADER_INTS, "<i4")
        header[:3] = self.magic, self.version, count
        return header.tobytes()

    def _finish(self) -> None:
        self.file.seek(0)
        self.file.write(self._header(self.in_shard))
        self.file.close()
        os.replace(self._path() + ".tmp", self._path())
        self.files.append(os.path.basename(self._path()))
        self.file, self.in_shard = None, 0


def _cores() -> int:
    """The cores this process may run on (its affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def doc_separator(text: str) -> bytes:
    """--doc_separator's bytes: UTF-8, with the escapes \\n, \\r, \\t and \\\\ read as a shell cannot type them."""
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}
    return re.sub(r"\\([nrt\\])", lambda m: escapes[m.group(1)], text).encode("utf-8")


def check(args: argparse.Namespace) -> tuple[list[str], int]:
    """The input files and the validation split's first byte; ConfigError on bad input, before anything is read or
    written (what only the text can show, invalid UTF-8 or an empty split, is found on the way; prepare removes
    what it wrote then)."""
    if not 0.0 < args.val_fraction < 1.0:
        raise ConfigError("--val_fraction", args.val_fraction, "a number in (0, 1)")
    if args.shard_tokens < 1:
        raise ConfigError("--shard_tokens", args.shard_tokens, "an integer >= 1")
    if args.vocab is not None and args.vocab < 256:
        raise ConfigError("--vocab", args.vocab, "an integer >= 256 (a byte-level BPE starts from the 256 bytes)")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise ConfigError(
            "--tokenizer", args.tokenizer, "an existing tokenizer.json file or a Hugging Face model directory"
        )
    files = input_files(args.inputs)
    total = sum(os.path.getsize(f) for f in files)
    val_from = int(np.floor(total * (1.0 - args.val_fraction)))
    if val_from == 0:
        raise ConfigError(
            "--val_fraction", args.val_fraction, f"a fraction leaving some training text ({total} bytes in all)"
        )
    if os.path.exists(args.out) and (
        not os.path.isdir(args.out)
        or glob.glob(os.path.join(glob.escape(args.out), "*.bin"))
        or os.path.exists(os.path.join(args.out, META_FILE))
    ):
        raise ConfigError("--out", args.out, "a new or empty directory (this one holds shards or a meta.json already)")
    return files, val_from


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Write the shards, tokenizer.json and meta.json (into a temporary directory inside --out, moved into place at
    the end: a fault leaves --out as it was); returns meta.json's content."""
    files, val_from = check(args)
    separator = doc_separator(args.doc_separator)
    total = sum(os.path.getsize(f) for f in files)
    if not args.no_progress and sys.stderr.isatty():  # a fault stays one line in logs
        how = (
            f"a byte-level BPE of {args.vocab} tokens trained on the training text, then encoding"
            if args.vocab
            else f"encoding with {args.tokenizer}"
            if args.tokenizer
            else "plain bytes"
        )
        print(
            f"jaxloop.prepare: {len(files)} file{'s' * (len(files) > 1)}, {total / 1e6:.1f} MB -> {args.out}: {how}",
            file=sys.stderr,
            flush=True,
        )
    created = not os.path.exists(args.out)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".prepare-", dir=args.out)
    try:
        meta = _prepare_into(work, args, files, val_from, separator)
        for name in sorted(os.listdir(work), key=lambda n: n == META_FILE):  # meta.json last: then it is complete
            os.replace(os.path.join(work, name), os.path.join(args.out, name))
        os.rmdir(work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        if created:
            shutil.rmtree(args.out, ignore_errors=True)
        raise
    return meta


def _prepare_into(
    work: str, args: argparse.Namespace, files: list[str], val_from: int, separator: bytes
) -> dict[str, Any]:
    eot_needed = len(files) > 1 or bool(separator)
    tokenizer = load_tokenizer(args, files, val_from, separator, eot_needed)
    vocab = (257 if eot_needed else 256) if tokenizer is None else tokenizer.get_vocab_size()
    eot = None if not eot_needed else 256 if tokenizer is None else tokenizer.token_to_id(EOT)
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    name = args.name or os.path.splitext(os.path.basename(files[0]))[0]
    writers = {s: ShardWriter(work, name, s, dtype, args.shard_tokens) for s in ("train", "val")}
    # pieces encoded at once: one per core, at most BATCH_PIECES (their Encodings take ~25x their text's memory)
    batch_pieces = 1 if tokenizer is None else min(_cores(), BATCH_PIECES)
    passes = " (pass 2 of 2)" if args.vocab else ""
    with _bar(args, sum(os.path.getsize(f) for f in files), f"encoding{passes}") as bar:
        batch: list[Piece] = []
        first = True
        for piece in itertools.chain(pieces(files, val_from, separator=separator), [None]):
            if piece is not None:
                batch.append(piece)
            if batch and (piece is None or len(batch) == batch_pieces):
                for p, tokens in zip(batch, encode_batch(tokenizer, batch, eot, first)):
                    writers[p.split].add(tokens)
                    bar.update(len(p.data))
                batch, first = [], False
    for w in writers.values():
        w.close()
    for split, w in writers.items():
        if w.tokens == 0:
            raise ConfigError("--val_fraction", args.val_fraction, f"a fraction leaving some {split} text")
    kind = "bytes" if tokenizer is None else ("file" if args.tokenizer else "bpe")
    if (
        args.tokenizer
        and os.path.isfile(args.tokenizer)
        and tokenizer is not None  # always, with --tokenizer
        and tokenizer.get_vocab_size() == vocab
        and (not eot_needed or read_tokenizer(args.tokenizer).token_to_id(EOT) is not None)
    ):
        shutil.copyfile(args.tokenizer, os.path.join(work, TOKENIZER_FILE))
    elif tokenizer is not None:
        tokenizer.save(os.path.join(work, TOKENIZER_FILE))
    meta = {
        "format": "llm.c",
        "vocab_size": vocab,
        "dtype": dtype,
        "tokenizer": kind,
        "tokenizer_file": None if tokenizer is None else TOKENIZER_FILE,
        "tokenizer_from": os.path.abspath(args.tokenizer) if args.tokenizer else None,
        "eot": eot,
        "doc_separator": args.doc_separator or None,
        "inputs": [os.path.abspath(f) for f in files],
        "val_fraction": args.val_fraction,
        "tokens": {s: w.tokens for s, w in writers.items()},
        "shards": {s: w.files for s, w in writers.items()},
    }
    with open(os.path.join(work, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return meta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxloop.prepare", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="text files or globs, read in the order given")
    p.add_argument("--out", required=True, help="directory for the shards and meta.json (new or empty)")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="a local tokenizer.json (HF tokenizers), or a Hugging Face "
        "model directory (its tokenizer.json, or vocab.json + merges.txt)",
    )
    how.add_argument("--vocab", type=int, metavar="N", help="train a byte-level BPE of N tokens on the training text")
    p.add_argument("--val_fraction", type=float, default=0.1, help="the last fraction of the text that validates")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (llm.c's 100M)")
    p.add_argument("--name", default="", help="shard file prefix (default: the first input's name)")
    p.add_argument(
        "--doc_separator",
        default="",
        metavar="TEXT",
        help="text that ends a document inside a file (e.g. '\\n\\n\\n'; \\n \\r \\t \\\\ escapes): "
        "dropped, and an end-of-text token put between the documents (default: none; one goes between files)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar (it shows on a terminal only anyway)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse, check, write; exit status 0, or 2 on bad input (one line on stderr)."""
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        meta = prepare(args)
    except ConfigError as e:
        print(f"jaxloop.prepare: error: {e}", file=sys.stderr)
        return 2
    print(
        f"done: {meta['tokens']['train']} training and {meta['tokens']['val']} validation tokens "
        f"(vocabulary {meta['vocab_size']}, {meta['dtype']}) in {len(meta['shards']['train'])} + "
        f"{len(meta['shards']['val'])} shards in {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
