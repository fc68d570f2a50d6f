"""The one reader and runner of the code blocks of README.md and docs/*.md; every test of a page's code uses it.

How the pages' blocks are run (the convention for whoever writes them):
- A page's ```python blocks run as they are, in order, as one program (a later block may use what an
  earlier one defined), in a fresh process whose working directory is a new temporary directory that
  holds the repository's top-level entries as links (so `tests/data/...` and `benchmarks/...` resolve and
  `runs/` is new). What each block printed is kept apart (`PageRun.outputs`). The program compiles into the
  test session's JAX cache (`python_env`), as the session's own compiles and the CLI's runs do: the port
  check the README shows is docs/porting.md's first block, compiled once.
- A page's ```bash blocks run too, in order, with `bash -e`, in one such directory of their own, with
  this interpreter first on PATH as `python` and the repository on PYTHONPATH.
- A ```bash block right after a line `<!-- not run: REASON -->` is not run, and the reason is required.
  Python blocks are always run.
- Blocks that name torch, torch_ref, parity_tests or jaxloop.parity (the port check) need torch: they run
  apart, in tests marked `torch` (a page's python program: all of it, when any block needs torch).
- ```text blocks (a diagram, sample output) are not code and are not run.
Each page's program runs once per test session (the `doc_run` fixture of tests/conftest.py); tests that
promise more of a block (what it prints, the files it writes) read that run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- not run: (?P<reason>.*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
NEEDS_TORCH = re.compile(r"\btorch\b|torch_ref|parity_tests|jaxloop\.parity")
TIMEOUT_S = 600
SEPARATOR = "\x1e-- end of a docs block --\x1e"
"""Printed by the runner after each python block, so that each block's output can be told apart."""


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    body: str
    reason: str | None
    """Why it is not run (`<!-- not run: REASON -->`); None: it runs."""
    heading: str
    """The last `#` heading above it ("" before any)."""

    @property
    def needs_torch(self) -> bool:
        return bool(NEEDS_TORCH.search(self.body))


@dataclass(frozen=True)
class PageRun:
    """A page's blocks of one language, run: the exit status, what each block printed, stderr, the directory."""

    returncode: int
    outputs: list[str]
    stderr: str
    cwd: Path
    failed: str = ""
    """The bash block that failed ("" when none did, and for python)."""


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path) -> list[Block]:
    """Every fenced block of the page, in order, run or not."""
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        headings = re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text[: m.start()], flags=re.S | re.M), re.M)
        out.append(Block(page, m["lang"], m["body"], m["reason"], headings[-1] if headings else ""))
    return out


def runnable(page: Path, lang: str, torch: bool) -> list[Block]:
    """The blocks of `lang` that one run of the page runs, with torch or without (see the module doc)."""
    run = [b for b in blocks(page) if b.lang == lang and b.reason is None]
    if lang == "python":
        return run if any(b.needs_torch for b in run) == torch else []
    return [b for b in run if b.needs_torch == torch]


def in_section(page: Path, heading: str, lang: str = "python") -> Block:
    """The first block of `lang` under the heading `heading` (its text without the #s)."""
    return next(b for b in blocks(page) if b.lang == lang and b.heading == heading)


def workdir(tmp_path: Path) -> Path:
    """A directory that looks like the repository's top level (links), with nothing run in it yet."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "__pycache__"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def env() -> dict[str, str]:
    """The environment the blocks run in: the repository importable, this interpreter as `python`, no network
    for Hugging Face."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }


def python_env() -> dict[str, str]:
    """env() with JAX's persistent cache on in the session's directory (conftest.py: the command's default
    --compile_cache), every executable kept as jaxloop.runtime.compilation keeps them: what a page's program
    compiles outside jaxloop.run (the port check, jit calls of its own) is loaded by a later page or test.
    Inside jaxloop.run the run's compile_cache decides, as in the session."""
    from jaxloop.config.run import Config
    from jaxloop.runtime.compilation import cache_settings

    settings = cache_settings(Path(Config().compile_cache).expanduser().resolve())
    return {**env(), **{key.upper(): str(value) for key, value in settings.items()}}


def run(page: Path, lang: str, torch: bool, cwd: Path) -> PageRun:
    """Run the page's blocks of `lang` (runnable(page, lang, torch)) in `cwd` (a workdir)."""
    code = [b.body for b in runnable(page, lang, torch)]
    if lang == "python":
        mark = f"\nprint({SEPARATOR!r}, flush=True)\n"
        (cwd / "page.py").write_text("".join(body + mark for body in code))
        out = subprocess.run(
            [sys.executable, "page.py"], cwd=cwd, env=python_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        outputs = out.stdout.split(SEPARATOR + "\n")[: len(code)]
        return PageRun(out.returncode, outputs, out.stderr, cwd)
    outputs = []
    for body in code:
        out = subprocess.run(
            ["bash", "-e", "-c", body], cwd=cwd, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        outputs.append(out.stdout)
        if out.returncode != 0:
            return PageRun(out.returncode, outputs, out.stderr, cwd, failed=body)
    return PageRun(0, outputs, "", cwd)
