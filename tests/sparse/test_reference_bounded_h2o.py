"""Bounded H2O prefill against the plain reference of its rule (tests/bounded_reference.py,
the rule of sparse/h2o.py's docstring), on the real compaction path (`run_hooks`):
cumulative scores of every query, cut back to the budget after every chunk."""

from __future__ import annotations

import math

import pytest
import torch

from bounded_reference import ref_bounded_h2o, run_hooks
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.h2o import H2O

HQ, HKV, D = 4, 2, 16
SCALE = 1.0 / math.sqrt(D)
SINK, RECENT = 2, 4


def h2o(budget: int = 20, chunk: int = 8) -> H2O:
    config = EngineConfig.create(
        sparse_method="h2o",
        decode_keep_tokens=budget,
        sink_keep_tokens=SINK,
        recent_keep_tokens=RECENT,
        chunk_prefill_size=chunk,
    )
    return H2O(config, 2, HKV)


def random_qk(n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(n, HQ, D, generator=g) for _ in range(2)],
        [torch.randn(n, HKV, D, generator=g) for _ in range(2)],
    )


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunks", [[8] * 10, [8, 8, 5, 8, 8, 3, 8, 6], [12] * 6 + [1]])
def test_bounded_h2o_keeps_what_the_reference_keeps(seed, chunks):
    chunk = max(chunks)
    q, k = random_qk(sum(chunks), seed)
    m = h2o(chunk=chunk)
    kept, asked, peaks = run_hooks(m, q, k, chunks, SCALE)
    assert asked == chunks  # every query votes
    for layer in range(2):
        ref, gap = ref_bounded_h2o(q[layer], k[layer], chunks, 20, SINK, RECENT, SCALE)
        assert gap > 1e-6, "seed has a near-tie at a cut; pick another"
        assert kept[layer] == ref
    assert max(max(p) for p in peaks) <= 20 + chunk


def test_unbounded_h2o_cuts_only_at_the_prompt_end():
    chunks = [8] * 10
    q, k = random_qk(80, 0)
    _, _, peaks = run_hooks(h2o(), q, k, chunks, SCALE, bounded=False)
    assert [p[0] for p in peaks] == list(range(8, 81, 8))  # the whole prompt resident
    step = SeqStep(0, 0, 16, 8, 80, True)
    assert h2o().cuts_chunk(step) and not h2o().cuts_chunk(SeqStep(0, 0, 72, 8, 80, True))


def test_a_budget_covering_the_prompt_keeps_everything():
    q, k = random_qk(48, 1)
    kept, _, _ = run_hooks(h2o(budget=64), q, k, [8] * 6, SCALE)
    assert kept == [[list(range(48))] * HKV] * 2


def test_bounded_resident_is_budget_plus_interval_plus_chunk():
    m = h2o(budget=20, chunk=8)  # interval 16
    assert m.bounded_resident(1000, 100) == 20 + 16 + 8
    assert m.bounded_resident(10, 5) == 15
    assert m.max_resident(1000, 100) == 1000 + 8
