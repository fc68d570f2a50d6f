"""Every code block of README.md and docs/*.md runs, and every relative link resolves.

How the pages' blocks are run (the convention for whoever writes them):
- A page's ```python blocks run as they are, in order, as one program (a later block may use what an
  earlier one defined), in a fresh process whose working directory is a new temporary directory that
  holds the repository's top-level entries as links (so `tests/data/...` and `benchmarks/...` resolve and
  `runs/` is new).
- A page's ```bash blocks run too, in order, with `bash -e`, in one such directory of their own, with
  this interpreter first on PATH as `python` and the repository on PYTHONPATH.
- A ```bash block right after a line `<!-- not run: REASON -->` is not run, and the reason is required:
  the install commands at the top of README (test_readme.py and .ci/run check those), a suite of 15
  minutes, several hosts. Python blocks are always run.
- Blocks that name torch, torch_ref, parity_tests or jaxloop.parity (the port check) need torch: they run
  apart, in tests marked `torch`.
- ```text blocks (a diagram, sample output) are not code and are not run.
Keep the examples small (`--preset debug`, a few updates): these tests run them all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^(?:<!-- not run: (?P<reason>.*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
NEEDS_TORCH = re.compile(r"\btorch\b|torch_ref|parity_tests|jaxloop\.parity")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
TIMEOUT_S = 600


def blocks(page: Path) -> list[dict[str, str | None]]:
    return [m.groupdict() for m in BLOCK.finditer(page.read_text())]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _cases(lang: str) -> list:
    """One case per page and torch need, for the blocks of `lang` that run."""
    cases = []
    for page in PAGES:
        run = [b for b in blocks(page) if b["lang"] == lang and b["reason"] is None]
        for torch in (False, True):
            group = [b["body"] for b in run if bool(NEEDS_TORCH.search(b["body"])) == torch]
            if lang == "python" and any(NEEDS_TORCH.search(b["body"]) for b in run):
                group = [b["body"] for b in run] if torch else []  # one program: all of it or none
            if group:
                marks = [pytest.mark.torch] if torch else []
                cases.append(pytest.param(page, group, marks=marks, id=f"{name(page)}{'-torch' if torch else ''}"))
    return cases


def workdir(tmp_path: Path) -> Path:
    """A directory that looks like the repository's top level (links), with nothing run in it yet."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "__pycache__"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


@pytest.mark.parametrize(("page", "code"), _cases("python"))
def test_python_blocks_run(page, code, tmp_path):
    cwd = workdir(tmp_path)
    (cwd / "page.py").write_text("\n\n".join(code))
    out = subprocess.run([sys.executable, "page.py"], cwd=cwd, env=env(), capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert out.returncode == 0, f"{name(page)}'s python blocks failed:\n{out.stderr[-3000:]}"


@pytest.mark.parametrize(("page", "code"), _cases("bash"))
def test_bash_blocks_run(page, code, tmp_path):
    cwd = workdir(tmp_path)
    for block in code:
        out = subprocess.run(["bash", "-e", "-c", block], cwd=cwd, env=env(), capture_output=True, text=True,
                             timeout=TIMEOUT_S)
        assert out.returncode == 0, f"{name(page)}: this block failed:\n{block}\n{out.stderr[-3000:]}"


def test_only_bash_blocks_are_left_unrun_and_each_says_why():
    unrun = [(name(p), b) for p in PAGES for b in blocks(p) if b["reason"] is not None]
    assert all(b["lang"] == "bash" and b["reason"].strip() for _, b in unrun), unrun
    # the two opening install commands are among them (test_readme.py and .ci/run check those)
    opening = [b for b in blocks(ROOT / "README.md") if b["lang"] == "bash"][:2]
    assert all(b["reason"] for b in opening)
    # every other block is run: a fence without a language (or another one) would be neither run nor marked;
    # ```text holds what is no code (a diagram, sample output)
    langs = {(name(p), b["lang"]) for p in PAGES for b in blocks(p)}
    assert {lang for _, lang in langs} <= {"python", "bash", "text"}, langs


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped,
    spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def test_slug_is_githubs():
    assert slug("Start-up: two caches behind `--compile_cache`") == "start-up-two-caches-behind---compile_cache"
    assert slug("Validation, EMA and early stopping") == "validation-ema-and-early-stopping"
    assert slug("Outputs in `run_dir`") == "outputs-in-run_dir"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are no links
    broken = []
    for groups in LINK.findall(text):
        target = groups[0] or groups[1]
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{name(page)}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in readme] == []


def test_no_code_block_names_loopcore():
    """Everything a user writes comes from `jaxloop` (loopcore is the package's jax-free core, not a name
    for users): no README or docs code block (python, bash) imports or names it. A ```text block, the
    layout of the source tree in docs/training.md, may."""
    naming = [(name(p), b["body"].splitlines()[0]) for p in PAGES for b in blocks(p)
              if b["lang"] in ("python", "bash") and "loopcore" in b["body"]]
    assert naming == [], naming
