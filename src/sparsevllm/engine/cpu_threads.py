"""How many threads the CPU engine computes with.

torch's default is one thread per core of the machine. Its OpenMP threads meet at a
barrier after every operator, and a decode step is about a thousand small operators: when
another process keeps one of the cores busy, every barrier waits for the thread that lost
its core, and the CLI decoded 20x slower (1.4 vs 26.8 tokens/s on 2 cores). So the engine
counts the cores it may run on (the process's CPU affinity, e.g. `taskset` or a container's
cpuset) and leaves out those that another process keeps busy, sampled for a tenth of a
second at start. An explicit `cpu_threads`, or `OMP_NUM_THREADS` from the environment,
wins over the count.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

# A core counts as taken when it was busy for more than this share of the sample.
BUSY_SHARE = 0.5
SAMPLE_S = 0.1


def choose_cpu_threads(requested: int | None) -> tuple[int, str]:
    """The thread count and why: `requested` (the config's `cpu_threads`), else
    `OMP_NUM_THREADS`, else the free cores of the affinity mask (at least one)."""
    if requested is not None:
        return requested, "cpu_threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = sorted(os.sched_getaffinity(0))
    busy = busy_cores(cores, SAMPLE_S)
    free = max(1, len(cores) - len(busy))
    why = f"{len(cores)} cores in the affinity mask"
    if busy:
        why += f", {len(busy)} kept busy by other processes ({sorted(busy)})"
    return free, why


def apply_cpu_threads(requested: int | None, share: int = 1) -> int:
    """Set torch's intra-op threads for a CPU engine; returns the count. `share`: how
    many processes split the cores found (tensor-parallel ranks), when none is asked for."""
    threads, why = choose_cpu_threads(requested)
    if requested is None and share > 1:
        threads = max(1, threads // share)
        why += f", shared by {share} tensor-parallel ranks"
    torch.set_num_threads(threads)
    logger.info("CPU threads: %d (%s)", threads, why)
    return threads


def busy_cores(cores: list[int], sample_s: float) -> set[int]:
    """The cores among `cores` busy for more than BUSY_SHARE of a `sample_s` sample
    (from /proc/stat; empty where it cannot be read)."""
    first = _cpu_times()
    time.sleep(sample_s)
    second = _cpu_times()
    busy = set()
    for core in cores:
        if core not in first or core not in second:
            continue
        (busy0, total0), (busy1, total1) = first[core], second[core]
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) > BUSY_SHARE:
            busy.add(core)
    return busy


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per core: (busy jiffies, total jiffies) since boot."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        values = [int(v) for v in fields]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        times[int(name[3:])] = (sum(values[:8]) - idle, sum(values[:8]))
    return times
