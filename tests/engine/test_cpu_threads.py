"""How many threads a CPU engine computes with: an explicit setting, OMP_NUM_THREADS, or
the free cores of the process's affinity mask."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from sparsevllm import LLM
from sparsevllm.engine import cpu_threads
from sparsevllm.engine.cpu_threads import busy_cores, choose_cpu_threads


def test_explicit_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_cpu_threads(5) == (5, "cpu_threads")


def test_omp_num_threads_wins_over_the_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_cpu_threads(None) == (2, "OMP_NUM_THREADS")


def test_counts_free_cores_of_the_affinity_mask(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cores, s: {2})
    threads, why = choose_cpu_threads(None)
    assert threads == 2
    assert "3 cores" in why and "[2]" in why
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda cores, s: set(cores))
    assert choose_cpu_threads(None)[0] == 1  # never zero


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_core_kept_busy_by_another_process_is_seen():
    core = max(os.sched_getaffinity(0))
    spin = "import os, time\nos.sched_setaffinity(0, {%d})\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin % core])
    try:
        time.sleep(0.5)  # the spinner is running on its core
        assert core in busy_cores(sorted(os.sched_getaffinity(0)), 0.3)
    finally:
        proc.kill()
        proc.wait()


def test_engine_sets_torch_threads(tiny_llama):
    before = torch.get_num_threads()
    try:
        LLM(tiny_llama, cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_bad_cpu_threads_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="cpu_threads"):
        LLM(tiny_llama, cpu_threads=0)
