"""Every code block of README.md and docs/*.md runs (how: tests/docs_blocks.py, the one runner), and every
relative link resolves.

Keep the examples small (`--preset debug`, a few updates): these tests run them all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_blocks import PAGES, ROOT, blocks, name, run, runnable, workdir

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _cases(lang: str) -> list:
    """One case per page and torch need, for the blocks of `lang` that run."""
    return [
        pytest.param(
            page, torch, marks=[pytest.mark.torch] if torch else [], id=f"{name(page)}{'-torch' if torch else ''}"
        )
        for page in PAGES
        for torch in (False, True)
        if runnable(page, lang, torch)
    ]


@pytest.mark.parametrize(("page", "torch"), _cases("python"))
def test_python_blocks_run(page, torch, doc_run):
    # mutant seen failing: a block of docs/hooks.md broken (a name misspelt)
    out = doc_run(page, "python", torch)
    assert out.returncode == 0, f"{name(page)}'s python blocks failed:\n{out.stderr[-3000:]}"


@pytest.mark.parametrize(("page", "torch"), _cases("bash"))
def test_bash_blocks_run(page, torch, doc_run):
    out = doc_run(page, "bash", torch)
    assert out.returncode == 0, f"{name(page)}: this block failed:\n{out.failed}\n{out.stderr[-3000:]}"


RUN_DIR = re.compile(r"\bruns/(?:shards/)?[\w.-]+")


def test_each_pages_examples_train_in_run_directories_of_their_own():
    # Run one after another in one checkout, as a reader does, two pages' commands on one run directory trip
    # over each other: a resume refused (steps 20 -> 30), "already complete" for a run of another shape.
    # mutant seen failing: docs/observing.md's command on runs/shakespeare again (README's)
    owner: dict[str, str] = {}
    shared = []
    for page in PAGES:
        for b in blocks(page):
            if b.reason is None and b.lang in ("python", "bash"):
                for run_dir in set(RUN_DIR.findall(b.body)):
                    if owner.setdefault(run_dir, name(page)) != name(page):
                        shared.append((run_dir, owner[run_dir], name(page)))
    assert shared == [], shared


def test_no_example_refuses_to_run_twice():
    # resume="never" on a run directory that exists (the example's own, from its first run) is an error:
    # mutant seen failing: the README's hooks example with "resume": "never" again
    never = re.compile(r"""resume["']?\s*[=:]\s*["']never["']|--resume never""")
    found = [
        (name(p), b.body.splitlines()[0])
        for p in PAGES
        for b in blocks(p)
        if b.reason is None and b.lang in ("python", "bash") and never.search(b.body)
    ]
    assert found == [], found


@pytest.mark.parametrize(
    ("page", "lang", "torch"),
    [
        pytest.param(
            page,
            lang,
            torch,
            marks=[pytest.mark.torch] if torch else [],
            id=f"{name(page)}-{lang}{'-torch' if torch else ''}",
        )
        for lang in ("python", "bash")
        for page in PAGES
        for torch in (False, True)
        if runnable(page, lang, torch)
    ],
)
def test_a_pages_commands_write_nothing_beside_the_repositorys_files_but_runs(page, lang, torch, doc_run):
    # the blocks run in a directory that links the repository's top-level entries: what they write anywhere
    # but runs/ (ignored by git) a reader running them in the checkout finds left in the repository.
    # mutant seen failing: docs/optimizers.md's --plot one_cycle.png again
    out = doc_run(page, lang, torch)
    left = sorted(p.name for p in out.cwd.iterdir() if not p.is_symlink() and p.name not in ("runs", "page.py"))
    assert left == [], f"{name(page)}'s {lang} blocks left {left} in the repository's top level"


def test_only_bash_blocks_are_left_unrun_and_each_says_why():
    unrun = [(name(p), b) for p in PAGES for b in blocks(p) if b.reason is not None]
    assert all(b.lang == "bash" and b.reason.strip() for _, b in unrun), unrun
    # the two opening install commands are among them (test_readme.py and .ci/run check those)
    opening = [b for b in blocks(ROOT / "README.md") if b.lang == "bash"][:2]
    assert all(b.reason for b in opening)
    # every other block is run: a fence without a language (or another one) would be neither run nor marked;
    # ```text holds what is no code (a diagram, sample output)
    langs = {(name(p), b.lang) for p in PAGES for b in blocks(p)}
    assert {lang for _, lang in langs} <= {"python", "bash", "text"}, langs


def test_every_block_not_marked_is_in_exactly_one_run_of_its_page():
    # mutant seen failing: runnable() leaving out the first python block of each page
    for page in PAGES:
        for lang in ("python", "bash"):
            ran = runnable(page, lang, torch=False) + runnable(page, lang, torch=True)
            to_run = [b for b in blocks(page) if b.lang == lang and b.reason is None]
            assert sorted(b.body for b in ran) == sorted(b.body for b in to_run), (name(page), lang)


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
    assert slug("Start-up: `--compile_cache`") == "start-up---compile_cache"
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


def test_no_code_block_names_the_internal_layers():
    """Everything a user writes comes from `jaxloop` (jaxloop.config and jaxloop.rundir are the package's
    jax-free internals, not names for users): no README or docs code block (python, bash) imports or
    names them. A ```text block, the layout of the source tree in docs/architecture.md, may."""
    naming = [
        (name(p), b.body.splitlines()[0])
        for p in PAGES
        for b in blocks(p)
        if b.lang in ("python", "bash") and re.search(r"jaxloop\.(core|config|rundir)\b", b.body)
    ]
    assert naming == [], naming


def test_a_pages_python_program_compiles_into_the_sessions_cache(compilation_cache_for_the_session, tmp_path):
    # what README's and docs/porting.md's port check (the same program) compile outside jaxloop.run is compiled
    # once in a session: jax reads these settings from the environment of the page's process.
    # mutant seen failing: run() giving the page's process env() (no cache)
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport jax\nc = jax.config\nprint(c.jax_compilation_cache_dir, "
        "c.jax_persistent_cache_min_compile_time_secs, c.jax_persistent_cache_min_entry_size_bytes, "
        "c.jax_compilation_cache_max_size > 0)\n```\n"
    )
    (tmp_path / "cwd").mkdir()
    out = run(page, "python", False, workdir(tmp_path / "cwd"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.outputs[0].split() == [str(compilation_cache_for_the_session), "0.0", "0", "True"], out.outputs
