"""`python -m jaxloop.prepare`: text in, llm.c shards and meta.json out, read back by the tokens source; plain
bytes, a byte-level BPE trained on the text, a local tokenizer.json; bad input is one line, exit 2, nothing
written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloop import prepare
from jaxloop.config.run import DataConfig, preset, replace
from jaxloop.data.shards import read_shard
from jaxloop.data.sources import load_splits

TEXT = Path(__file__).parent / "data" / "tinyshakespeare_60k.txt"


def _run(*argv: str) -> dict:
    args = prepare.parser().parse_args([*argv, "--no_progress"])
    return prepare.prepare(args)


def _tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([read_shard(str(out / f)).tokens() for f in meta["shards"][split]]).astype(np.int64)


def test_bytes_shards_hold_the_text_split_at_a_line_near_the_fraction(tmp_path):
    meta = _run(str(TEXT), "--out", str(tmp_path), "--shard_tokens", "20000")
    raw = TEXT.read_bytes()
    train, val = _tokens(tmp_path, "train"), _tokens(tmp_path, "val")
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw
    assert raw[len(train) - 1 : len(train)] == b"\n" and not raw[len(train) : len(train) + 1].isspace()
    assert int(len(raw) * 0.9) <= len(train) < int(len(raw) * 0.9) + 200  # the first line start at 90%
    assert (meta["vocab_size"], meta["dtype"], meta["tokenizer"]) == (256, "uint16", "bytes")
    assert meta["shards"]["train"] == [f"tinyshakespeare_60k_train_{i:06d}.bin" for i in range(3)]
    assert meta["tokens"] == {"train": len(train), "val": len(val)}


def test_a_trained_bpe_round_trips_and_its_pieces_encode_as_the_whole_text(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.setattr(prepare, "PIECE_BYTES", 4096)  # many pieces: cut only before a non-space line start
    meta = _run(str(TEXT), "--out", str(tmp_path / "bpe"), "--vocab", "400")
    tok = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    train, val = _tokens(tmp_path / "bpe", "train"), _tokens(tmp_path / "bpe", "val")
    text = TEXT.read_text()
    assert meta["vocab_size"] == tok.get_vocab_size() == 400 and meta["tokenizer"] == "bpe"
    assert tok.decode(train.tolist()) + tok.decode(val.tolist()) == text
    train_text = tok.decode(train.tolist())
    assert train.tolist() == tok.encode(train_text, add_special_tokens=False).ids, "pieces encode as the whole"
    assert len(train) < 0.6 * len(train_text), "BPE merges bytes"
    # the saved tokenizer.json, given back, writes the same tokens
    _run(str(TEXT), "--out", str(tmp_path / "file"), "--tokenizer", str(tmp_path / "bpe" / "tokenizer.json"))
    assert (_tokens(tmp_path / "file", "train") == train).all() and (_tokens(tmp_path / "file", "val") == val).all()


def test_the_tokens_source_reads_what_prepare_wrote(tmp_path):
    _run(str(TEXT), "--out", str(tmp_path), "--vocab", "300", "--shard_tokens", "10000")
    base = preset("shakespeare")
    cfg = replace(base, data=DataConfig(source="tokens", path=str(tmp_path)), model=replace(base.model, context=32))
    splits = load_splits(cfg)
    train = _tokens(tmp_path, "train")
    assert splits.num_classes == 300
    assert splits.train.get([0])["x"][0].tolist() == train[:32].tolist()


def test_pieces_are_cut_only_where_the_whole_text_would_split_its_words(tmp_path, monkeypatch):
    # indented lines: a byte-level BPE's pre-tokenizer joins a newline to the spaces after it ("\n " + " x"),
    # so a piece must not end before a line that starts with a space
    lines = [f"def f{i}(x):\n    return x + {i}\n\n  # note {i}\n" for i in range(300)]
    (tmp_path / "code.txt").write_text("".join(lines))
    monkeypatch.setattr(prepare, "PIECE_BYTES", 256)
    _run(str(tmp_path / "code.txt"), "--out", str(tmp_path / "out"), "--vocab", "1000")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    train = _tokens(tmp_path / "out", "train")
    assert train.tolist() == tok.encode(tok.decode(train.tolist()), add_special_tokens=False).ids


@pytest.mark.parametrize(
    "case, says",
    [("not utf-8", "UTF-8"), ("out holds shards", "--out"), ("vocab below 256", "--vocab"), ("no input", "inputs")],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, case, says):
    out = tmp_path / "out"
    args = [str(TEXT), "--out", str(out), "--vocab", "300"]
    if case == "not utf-8":
        (tmp_path / "bad.txt").write_bytes(b"some line\n" * 50 + b"caf\xe9\n" + b"more\n" * 10)
        args[0] = str(tmp_path / "bad.txt")
    elif case == "out holds shards":
        out.mkdir()
        (out / "old_train_000000.bin").write_bytes(b"")
    elif case == "vocab below 256":
        args[-1] = "100"
    else:
        args[0] = str(tmp_path / "*.txt")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.prepare", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("jaxloop.prepare: error: ")
    assert says in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def _tiny_tokenizer():
    """A 300-token byte-level BPE trained here on the test text (GPT-2's pre-tokenizer and decoder): what a Hugging
    Face model directory ships, without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT.read_text()[:20000]],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    return tok


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.json + merges.txt"])
def test_tokenizer_accepts_a_hugging_face_model_directory(tmp_path, layout):
    # a model directory with tokenizer.json, or only GPT-2's older pair vocab.json + merges.txt: the shards hold
    # that tokenizer's ids, the pretrained model's vocabulary
    tok = _tiny_tokenizer()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    if layout == "tokenizer.json":
        tok.save(str(model_dir / "tokenizer.json"))
    else:
        tok.model.save(str(model_dir))
        assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "merges.txt", "vocab.json"]
    meta = _run(str(TEXT), "--out", str(tmp_path / "out"), "--tokenizer", str(model_dir))
    train, val = _tokens(tmp_path / "out", "train"), _tokens(tmp_path / "out", "val")
    text = TEXT.read_text()
    assert (meta["vocab_size"], meta["tokenizer"], meta["tokenizer_from"]) == (300, "file", str(model_dir))
    assert train.tolist() + val.tolist() == tok.encode(text, add_special_tokens=False).ids
    saved = prepare.read_tokenizer(str(tmp_path / "out" / "tokenizer.json"))
    assert saved.decode(train.tolist() + val.tolist()) == text


def test_tokenizer_directory_without_tokenizer_files_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.prepare",
            str(TEXT),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--tokenizer" in proc.stderr and "vocab.json and merges.txt" in proc.stderr
    assert not (tmp_path / "out").exists()


def _tokens_of(out: Path) -> list[int]:
    return _tokens(out, "train").tolist() + _tokens(out, "val").tolist()


def test_an_end_of_text_token_goes_between_files_and_between_separated_documents(tmp_path):
    # plain bytes: the end-of-text token is 256 (a vocabulary of 257); --doc_separator's bytes are dropped
    (tmp_path / "a.txt").write_text("First file.\nIt ends here.\n")
    (tmp_path / "b.txt").write_text("Doc one.\n\n\nDoc two,\nlonger.\n\n\nDoc three.\n")
    a, b = (tmp_path / "a.txt").read_bytes(), (tmp_path / "b.txt").read_bytes()
    meta = _run(
        str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--out", str(tmp_path / "files"), "--val_fraction", "0.2"
    )
    assert (meta["vocab_size"], meta["eot"]) == (257, 256)
    assert _tokens_of(tmp_path / "files") == list(a) + [256] + list(b)
    meta = _run(
        str(tmp_path / "a.txt"),
        str(tmp_path / "b.txt"),
        "--out",
        str(tmp_path / "docs"),
        "--val_fraction",
        "0.2",
        "--doc_separator",
        "\\n\\n\\n",
    )
    docs = [list(a), *(list(d) for d in b.split(b"\n\n\n"))]
    assert _tokens_of(tmp_path / "docs") == docs[0] + [256] + docs[1] + [256] + docs[2] + [256] + docs[3]
    # a BPE: the token <|endoftext|> among its ids, never inside a document's
    meta = _run(
        str(TEXT),
        str(tmp_path / "b.txt"),
        "--out",
        str(tmp_path / "bpe"),
        "--vocab",
        "300",
        "--doc_separator",
        "\\n\\n\\n",
    )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    ids = _tokens_of(tmp_path / "bpe")
    assert meta["eot"] == tok.token_to_id("<|endoftext|>") is not None and ids.count(meta["eot"]) == 3


def test_one_file_without_a_separator_has_no_end_of_text_token(tmp_path):
    meta = _run(str(TEXT), "--out", str(tmp_path))
    assert (meta["vocab_size"], meta["eot"]) == (256, None)


PEAK_SCRIPT = """
import resource, subprocess, sys
subprocess.run([sys.executable, "-m", "jaxloop.prepare", *sys.argv[1:]], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _peak_rss_kib(*argv: str) -> int:
    """The peak RSS of `python -m jaxloop.prepare argv` (KiB), run as the only child of a fresh process on 2 cores."""
    import os

    def two_cores() -> None:  # prepare encodes a piece per core: the bound below is for 2
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])

    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *argv, "--no_progress"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        preexec_fn=two_cores,
    )
    return int(proc.stdout.split()[-1])


@pytest.mark.parametrize("how", ["bytes", "tokenizer"])
def test_memory_stays_bounded_on_a_single_line_file(tmp_path, how):
    # a 24 MB file of one line: read PIECE_BYTES (64 KiB) at a time and cut at UTF-8 boundaries, prepare's peak RSS
    # grows by under 64 MiB over the same run on a 200 kB line (measured: bytes 33 -> 33 MiB, a 300-token BPE
    # 62 -> 79 MiB; on 2 cores, two pieces' Encodings at a time). Holding the line whole, it grew by 208 MiB in
    # plain bytes (the line, its tokens) and by gigabytes with a tokenizer (~350 bytes of Encoding a token)
    words = "the quick brown fox jumps over a lazy dog, élan vital; "
    (tmp_path / "big.txt").write_text(words * (24_000_000 // len(words)))
    (tmp_path / "small.txt").write_text(words * (200_000 // len(words)))
    extra = []
    if how == "tokenizer":
        _tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
        extra = ["--tokenizer", str(tmp_path / "tokenizer.json")]
    small = _peak_rss_kib(str(tmp_path / "small.txt"), "--out", str(tmp_path / "out_small"), *extra)
    big = _peak_rss_kib(str(tmp_path / "big.txt"), "--out", str(tmp_path / "out_big"), *extra)
    meta = json.loads((tmp_path / "out_big" / "meta.json").read_text())
    assert sum(meta["tokens"].values()) > (6_000_000 if how == "tokenizer" else 24_000_000)
    assert (big - small) / 1024 < 64, f"peak RSS {small / 1024:.0f} MiB on 200 kB, {big / 1024:.0f} MiB on 24 MB"
