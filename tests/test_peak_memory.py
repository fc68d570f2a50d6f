"""The memory a CPU run records is the process's true peak resident set (Linux VmHWM) with its live worker
processes', not the resident set at the moment a record is written: a compile or an evaluation that takes memory
and gives it back between two records still counts (jaxloop.observe.runinfo.memory_bytes)."""

from __future__ import annotations

import mmap
import multiprocessing
import sys
import time

import psutil
import pytest

from jaxloop.observe import runinfo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's /proc")
MiB = 2**20


@pytest.fixture
def cpu_backend(monkeypatch):
    monkeypatch.setattr(runinfo, "_device_memory_stats", lambda: None)  # what the CPU backend reports


def test_memory_taken_and_given_back_between_samples_counts(cpu_backend):
    me = psutil.Process()
    # an anonymous mapping of its own, whatever the allocator's settings (a run's host_memory keeps freed memory)
    block = mmap.mmap(-1, 256 * MiB)
    block.write(b"\1" * (256 * MiB))  # touched: 256 MiB resident
    held = me.memory_info().rss
    block.close()  # unmapped: given back to the OS at once
    assert me.memory_info().rss < held - 128 * MiB  # what the current RSS, the mutant, then reads
    # the peak is at least what was resident while the block was held, within 16 MiB: the kernel's RSS counters
    # are batched per thread (psutil's statm and VmHWM can read a few pages apart), far less than the 256 MiB
    assert runinfo.memory_bytes() >= held - 16 * MiB


def test_a_live_worker_process_counts_with_its_own_peak(cpu_backend):
    code = "import numpy as np, time; block = np.ones(2**25); time.sleep(60)"  # 256 MiB in a spawned worker
    worker = multiprocessing.get_context("spawn").Process(target=exec, args=(code,), daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while (runinfo._vm_hwm(str(worker.pid)) or 0) < 256 * MiB and time.monotonic() < deadline:
            time.sleep(0.2)
        # the worker's own peak on top of this process's (0.9: the block is 256 MiB of its resident set)
        assert runinfo.memory_bytes() - runinfo._vm_hwm("self") >= 0.9 * 256 * MiB
    finally:
        worker.kill()
        worker.join()


def test_the_memory_source_names_the_peak(cpu_backend):
    assert runinfo.memory_source().startswith("process resident set size, its peak so far")
