"""`python -m jaxloop.prepare`: text files in, llm.c token shards out, for `--data.source tokens`.

    python -m jaxloop.prepare corpus/*.txt --out shards/                  # plain bytes (vocabulary 256)
    python -m jaxloop.prepare corpus/*.txt --out shards/ --vocab 4096     # a byte-level BPE trained on it
    python -m jaxloop.prepare corpus/*.txt --out shards/ --tokenizer tokenizer.json   # a local tokenizer

The inputs (files or globs, in the order given) are read as one stream; the last --val_fraction of its bytes,
from the first line there that starts with a non-space character, is the validation split, the rest the
training split. Text is encoded in pieces of about 1 MiB cut only before such lines (so that a byte-level
BPE's pre-tokenizer sees the same words as in the whole text), with Hugging Face `tokenizers`, without special
tokens; nothing is downloaded. Out come NAME_train_000000.bin, ... and NAME_val_000000.bin, ... in llm.c's
format (uint16 tokens for a vocabulary of at most 65536, else uint32), --shard_tokens tokens each, the
tokenizer as tokenizer.json (BPE and --tokenizer), and meta.json (vocab_size, tokenizer, dtype, counts),
written last: a directory with meta.json is complete. Bad input: one line, exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxloop.core.config import ConfigError
from jaxloop.core.shards import META_FILE, write_shard

PIECE_BYTES = 1 << 20
"""Text encoded at a time (cut only before a line that starts with a non-space character)."""
TOKENIZER_FILE = "tokenizer.json"


def input_files(patterns: list[str]) -> list[str]:
    """Each pattern's files (a glob's matches sorted), in the order given; ConfigError if one names none."""
    files: list[str] = []
    for pattern in patterns:
        found = sorted(f for f in glob.glob(pattern) if os.path.isfile(f)) if glob.has_magic(pattern) else (
            [pattern] if os.path.isfile(pattern) else [])
        if not found:
            raise ConfigError("inputs", pattern, "an existing text file or a glob matching some")
        files += found
    if sum(os.path.getsize(f) for f in files) == 0:
        raise ConfigError("inputs", patterns, "text files that are not all empty")
    return files


def pieces(files: list[str], val_from: int, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[str, bytes]]:
    """(split, bytes) pieces of the inputs' stream: "val" from the first line starting at or after byte
    `val_from` whose first byte is not whitespace (or a file's first line), "train" before. A piece ends at a
    file's end or before such a line."""
    offset, split = 0, "train"
    for path in files:
        buf: list[bytes] = []
        size = 0
        with open(path, "rb") as f:
            for line in f:
                can_cut = not buf or not line[:1].isspace()
                to_val = split == "train" and offset >= val_from and can_cut
                if buf and can_cut and (to_val or size >= piece_bytes):
                    yield split, b"".join(buf)
                    buf, size = [], 0
                if to_val:
                    split = "val"
                buf.append(line)
                size += len(line)
                offset += len(line)
        if buf:
            yield split, b"".join(buf)


def _texts(files: list[str], val_from: int, split: str) -> Iterator[str]:
    for s, piece in pieces(files, val_from):
        if s == split:
            yield piece.decode("utf-8")


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
            raise ValueError("a Hugging Face model directory holding tokenizer.json, or vocab.json and merges.txt "
                             "(this one holds neither)")
    elif not os.path.isfile(path):
        raise ValueError("an existing tokenizer.json file or a Hugging Face model directory")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer file is bad input
        raise ValueError(f"a readable tokenizer.json of HF tokenizers ({_short(e)})") from None


def _short(e: Exception) -> str:
    return " ".join(str(e).split())[:120]


def load_tokenizer(args: argparse.Namespace, files: list[str], val_from: int) -> Any:
    """The HF tokenizer (None for plain bytes): --tokenizer's (read_tokenizer), or a byte-level BPE of --vocab
    tokens trained on the training split."""
    if args.tokenizer:
        try:
            return read_tokenizer(args.tokenizer)
        except ValueError as e:
            raise ConfigError("--tokenizer", args.tokenizer, str(e)) from None
    if args.vocab:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(_texts(files, val_from, "train"), trainer)
        return tok
    return None


def encode(tokenizer: Any, piece: bytes) -> np.ndarray:
    """A piece's token ids: its bytes, or the tokenizer's ids without special tokens."""
    if tokenizer is None:
        return np.frombuffer(piece, np.uint8).astype(np.uint32)
    return np.asarray(tokenizer.encode(piece.decode("utf-8"), add_special_tokens=False).ids, np.uint32)


class ShardWriter:
    """Tokens of one split into NAME_SPLIT_000000.bin, ... of `per_shard` tokens each (llm.c's format)."""

    def __init__(self, out: str, name: str, split: str, dtype: str, per_shard: int):
        self.out, self.name, self.split, self.dtype, self.per_shard = out, name, split, dtype, per_shard
        self.parts: list[np.ndarray] = []
        self.held, self.tokens = 0, 0
        self.files: list[str] = []

    def add(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens)
        self.held += tokens.size
        self.tokens += tokens.size
        while self.held >= self.per_shard:
            joined = np.concatenate(self.parts)
            self._write(joined[:self.per_shard])
            self.parts, self.held = [joined[self.per_shard:]], joined.size - self.per_shard

    def close(self) -> None:
        if self.held:
            self._write(np.concatenate(self.parts))
        self.parts, self.held = [], 0

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.name}_{self.split}_{len(self.files):06d}.bin"
        write_shard(os.path.join(self.out, name), tokens, self.dtype)
        self.files.append(name)


def check(args: argparse.Namespace) -> tuple[list[str], int]:
    """The input files and the validation split's first byte; ConfigError on bad input, before anything is written."""
    if not 0.0 < args.val_fraction < 1.0:
        raise ConfigError("--val_fraction", args.val_fraction, "a number in (0, 1)")
    if args.shard_tokens < 1:
        raise ConfigError("--shard_tokens", args.shard_tokens, "an integer >= 1")
    if args.vocab is not None and args.vocab < 256:
        raise ConfigError("--vocab", args.vocab, "an integer >= 256 (a byte-level BPE starts from the 256 bytes)")
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise ConfigError("--tokenizer", args.tokenizer, "an existing tokenizer.json file or a Hugging Face model "
                          "directory")
    files = input_files(args.inputs)
    total = sum(os.path.getsize(f) for f in files)
    val_from = int(np.floor(total * (1.0 - args.val_fraction)))
    sizes = {"train": 0, "val": 0}
    for split, piece in pieces(files, val_from):
        sizes[split] += len(piece)
        if args.tokenizer or args.vocab:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError("inputs", args.inputs, f"UTF-8 text for a tokenizer (invalid UTF-8 near byte "
                                  f"{e.start} of a piece of {split} text); plain bytes (no --vocab or "
                                  "--tokenizer) take any file") from None
    for split, n in sizes.items():
        if n == 0:
            raise ConfigError("--val_fraction", args.val_fraction, f"a fraction leaving some {split} text (the "
                              f"{split} split starts at a line beginning with a non-space character)")
    if os.path.exists(args.out) and (not os.path.isdir(args.out) or glob.glob(os.path.join(glob.escape(args.out), "*.bin"))
                                     or os.path.exists(os.path.join(args.out, META_FILE))):
        raise ConfigError("--out", args.out, "a new or empty directory (this one holds shards or a meta.json already)")
    return files, val_from


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Write the shards, tokenizer.json and meta.json; returns meta.json's content."""
    from tqdm import tqdm

    files, val_from = check(args)
    tokenizer = load_tokenizer(args, files, val_from)
    vocab = 256 if tokenizer is None else tokenizer.get_vocab_size()
    dtype = "uint16" if vocab <= 2**16 else "uint32"
    name = args.name or os.path.splitext(os.path.basename(files[0]))[0]
    os.makedirs(args.out, exist_ok=True)
    writers = {s: ShardWriter(args.out, name, s, dtype, args.shard_tokens) for s in ("train", "val")}
    total = sum(os.path.getsize(f) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=args.no_progress or None) as bar:
        for split, piece in pieces(files, val_from):
            writers[split].add(encode(tokenizer, piece))
            bar.update(len(piece))
    for w in writers.values():
        w.close()
    kind = "bytes" if tokenizer is None else ("file" if args.tokenizer else "bpe")
    if args.tokenizer and os.path.isfile(args.tokenizer):
        shutil.copyfile(args.tokenizer, os.path.join(args.out, TOKENIZER_FILE))
    elif tokenizer is not None:
        tokenizer.save(os.path.join(args.out, TOKENIZER_FILE))
    meta = {"format": "llm.c", "vocab_size": vocab, "dtype": dtype, "tokenizer": kind,
            "tokenizer_file": None if tokenizer is None else TOKENIZER_FILE,
            "tokenizer_from": os.path.abspath(args.tokenizer) if args.tokenizer else None,
            "inputs": [os.path.abspath(f) for f in files],
            "val_fraction": args.val_fraction, "tokens": {s: w.tokens for s, w in writers.items()},
            "shards": {s: w.files for s, w in writers.items()}}
    tmp = os.path.join(args.out, META_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(args.out, META_FILE))
    return meta


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxloop.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="text files or globs, read in the order given")
    p.add_argument("--out", required=True, help="directory for the shards and meta.json (new or empty)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--tokenizer", metavar="PATH", help="a local tokenizer.json (HF tokenizers), or a Hugging Face "
                     "model directory (its tokenizer.json, or vocab.json + merges.txt)")
    how.add_argument("--vocab", type=int, metavar="N", help="train a byte-level BPE of N tokens on the training text")
    p.add_argument("--val_fraction", type=float, default=0.1, help="the last fraction of the text that validates")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (llm.c's 100M)")
    p.add_argument("--name", default="", help="shard file prefix (default: the first input's name)")
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
    print(f"done: {meta['tokens']['train']} training and {meta['tokens']['val']} validation tokens "
          f"(vocabulary {meta['vocab_size']}, {meta['dtype']}) in {len(meta['shards']['train'])} + "
          f"{len(meta['shards']['val'])} shards in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
