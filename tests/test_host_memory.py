"""The host allocator policy the loop sets: memory freed is reused without page faults."""

from __future__ import annotations

import subprocess
import sys

ROUNDS = r"""
import resource, sys
import numpy as np
if sys.argv[1] == "retain":
    from jaxloop.host_memory import retain_freed_memory
    assert retain_freed_memory()

def faults(mib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.empty(mib << 20, np.uint8)
    block[::4096] = 1  # touch every page
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(faults(24), faults(20))
"""


def _faults(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    first, second = map(int, out.stdout.split())
    return first, second


def test_retained_memory_is_reused_without_page_faults():
    """A 24 MiB block freed, then a 20 MiB one: with glibc's default policy the first is an mmap given
    back on free and the second faults in fresh pages (~500 faults each, measured); with the loop's
    policy the second reuses the first's pages (0 measured). Bound: a tenth of the first's faults."""
    first, second = _faults("retain")
    assert first > 100, "the first block is touched page by page"
    assert second < first / 10, (first, second)


def test_without_it_the_same_blocks_fault_afresh():
    """The control: the same rounds under glibc's default policy fault again (a test that cannot tell
    the policies apart would pass without retain_freed_memory)."""
    first, second = _faults("default")
    assert second > first / 2, (first, second)


def test_a_run_sets_the_policy_unless_told_not_to(tmp_path, monkeypatch):
    """jaxloop.run applies it (retain_host_memory, default on) and leaves it with the flag off."""
    from dataclasses import replace

    import jaxloop.loop
    from loopcore.config import preset

    calls = []
    monkeypatch.setattr(jaxloop.loop, "retain_freed_memory", lambda: calls.append(True) or True)
    base = replace(preset("debug"), steps=10, log=replace(preset("debug").log, progress="off", tensorboard=False))
    jaxloop.loop.run(replace(base, run_dir=str(tmp_path / "default")))
    jaxloop.loop.run(replace(base, run_dir=str(tmp_path / "off"), retain_host_memory=False))
    assert calls == [True], "once, for the run with the default"
