"""Scheduler on its own: continuous batching, chunking, admission, preemption, abort."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.scheduler import Scheduler
from sparsevllm.engine.sequence import SeqStatus, Sequence
from sparsevllm.sampling import SamplingParams


def make_seq(i: int, n_prompt: int, max_tokens: int = 4) -> Sequence:
    return Sequence(i, f"r{i}", list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler) -> dict[str, int]:
    """Advance like the engine would: computed tokens, then one sampled token."""
    out = sched.schedule()
    result = {}
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.start + s.num_new_tokens
        result[s.seq.request_id] = s.num_new_tokens
        if s.samples:
            s.seq.output_token_ids.append(0)
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
    return result


def test_scheduler_never_imports_torch():
    code = "import sys, sparsevllm.engine.scheduler; sys.exit('torch' in sys.modules)"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_chunked_prefill_and_token_budget():
    pool = KVPool(1000, 1, [[0]])
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=16, chunk_prefill_size=10)
    sched.add(make_seq(0, 25))
    sched.add(make_seq(1, 3))
    assert run_step(sched) == {"r0": 10, "r1": 3}
    assert run_step(sched) == {"r0": 10, "r1": 1}
    assert run_step(sched) == {"r0": 5, "r1": 1}
    assert run_step(sched) == {"r0": 1, "r1": 1}


def test_requests_join_and_leave_every_step():
    pool = KVPool(1000, 1, [[0]])
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64, chunk_prefill_size=64)
    for i in range(3):
        sched.add(make_seq(i, 4, max_tokens=2))
    assert run_step(sched) == {"r0": 4, "r1": 4}
    assert len(sched.waiting) == 1  # max_num_seqs holds r2 back
    assert run_step(sched) == {"r0": 1, "r1": 1}  # both finish here
    assert run_step(sched) == {"r2": 4}
    assert pool.num_used == 4


def test_preemption_by_recompute_frees_newest():
    pool = KVPool(12, 1, [[0]])
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, chunk_prefill_size=64)
    a, b = make_seq(0, 5, max_tokens=8), make_seq(1, 5, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # 10 slots used, both have one output token
    run_step(sched)  # 12 used
    out = sched.schedule()
    assert out.preempted == [b] and b.status == SeqStatus.WAITING
    assert b.num_computed_tokens == 0 and sched.stats.num_preemptions == 1
    assert pool.num_resident(b.seq_id) == 0
    assert [s.seq for s in out.scheduled] == [a]


def test_request_that_can_never_fit_fails_alone():
    pool = KVPool(6, 1, [[0]])
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, chunk_prefill_size=4)
    big = make_seq(0, 4, max_tokens=10)
    sched.add(big)
    for _ in range(3):
        run_step(sched)
    out = sched.schedule()
    assert big in out.failed and big.finish_reason == "error" and "KV slots" in big.error
    assert pool.num_used == 0


def test_abort_frees_slots():
    pool = KVPool(100, 1, [[0]])
    sched = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64, chunk_prefill_size=64)
    seq = make_seq(0, 10)
    sched.add(seq)
    run_step(sched)
    sched.finish(seq, "abort")
    assert pool.num_used == 0 and not sched.has_unfinished()
