"""The CPU engine's allocator setup: steps whose activations change size from one step to
the next (prefills of different lengths) stop faulting their memory in again."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)

# Three step sizes in turn, each step keeping 30 blocks alive and freeing them together
# (a prefill's per-layer outputs). Prints the page faults of the first step and of the
# last three (one of each size, after two rounds to settle).
_STEPS = textwrap.dedent(
    """
    import resource, sys, torch
    if sys.argv[1] == "tuned":
        from sparsevllm.engine.cpu_memory import keep_step_memory
        assert keep_step_memory()
    MIB = 1 << 18  # float32 elements

    def step(n):
        kept = []
        for _ in range(30):
            kept.append(torch.ones(n * MIB))
            scratch = torch.ones(2 * n * MIB)
            del scratch
        del kept

    faults = []
    for i in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step([6, 1, 3][i % 3])
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(faults[0], sum(faults[-3:]))
    """
)


def _faults(variant: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, variant], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, last = done.stdout.split()
    return int(first), int(last)


def test_steps_reuse_their_memory_once_tuned():
    first, last = _faults("tuned")
    assert last < first / 4, f"the last three steps faulted {last} pages (first step: {first})"


def test_glibc_defaults_fault_the_same_steps_in_again():
    # The baseline the setup exists for: without it the same steps keep faulting.
    first, last = _faults("default")
    assert last > first / 4, (first, last)
