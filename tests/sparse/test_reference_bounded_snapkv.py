"""Bounded SnapKV / PyramidKV prefill against the plain reference of its rule
(tests/bounded_reference.py, the rule of sparse/snapkv.py's docstring).

The method runs through its real hooks on the real KV path (`run_hooks`: a `KVPool`,
`DenseStorage` and `RunnerKV`), so every cut compacts the views per KV head and the
next chunk's scores are computed over the compacted keys (`attention_mass` of the rows
the method asks for, as the backend does). Queries and keys are random, fixed per
logical position. Pooling kernel 1: max pooling makes plateaus of equal votes, and a tie
broken differently at one cut changes every later one.
"""

from __future__ import annotations

import math

import pytest
import torch

from bounded_reference import ref_bounded_snapkv, run_hooks
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.pyramidkv import PyramidKV
from sparsevllm.sparse.snapkv import SnapKV

HQ, HKV, D = 4, 2, 16
SCALE = 1.0 / math.sqrt(D)
SINK, RECENT, WINDOW = 2, 4, 8


def config(method: str = "snapkv", budget: int = 20, chunk: int = 8, **kw) -> EngineConfig:
    return EngineConfig.create(
        sparse_method=method,
        decode_keep_tokens=budget,
        sink_keep_tokens=SINK,
        recent_keep_tokens=RECENT,
        snapkv_window_size=WINDOW,
        snapkv_pool_kernel_size=1,
        chunk_prefill_size=chunk,
        max_num_batched_tokens=max(chunk, 64),
        **kw,
    )


def random_qk(layers: int, n: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(n, HQ, D, generator=g) for _ in range(layers)]
    k = [torch.randn(n, HKV, D, generator=g) for _ in range(layers)]
    return q, k


def run(method: SnapKV, q, k, chunks: list[int], bounded: bool = True):
    return run_hooks(method, q, k, chunks, SCALE, bounded)


# (prompt chunks): the window inside the last chunk; the window split over the last two
# chunks (its first part is cut with rule 2b); uneven chunks, cut short by a step budget;
# chunks longer than the window (a moving window of their last 8 queries).
CHUNKINGS = [[8] * 12, [8] * 12 + [4], [8, 8, 5, 8, 8, 8, 3, 8, 8, 8, 8, 6], [12] * 8 + [5]]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_bounded_snapkv_keeps_what_the_reference_keeps(seed, chunks):
    layers, total = 2, sum(chunks)
    q, k = random_qk(layers, total, seed)
    chunk = max(chunks)
    m = SnapKV(config(chunk=chunk), layers, HKV)
    kept, asked, peaks = run(m, q, k, chunks)
    for layer in range(layers):
        ref, gap = ref_bounded_snapkv(
            q[layer], k[layer], chunks, 20, SINK, RECENT, WINDOW, 1, SCALE
        )
        assert gap > 1e-6, "seed has a near-tie at a cut; pick another"
        assert kept[layer] == ref
    assert max(max(p) for p in peaks) <= 20 + chunk  # budget + chunk
    assert m._window == {}  # the window state is dropped at the prompt's end


def test_bounded_score_rows_follow_the_rule():
    m = SnapKV(config(), 1, HKV)
    n = 100
    assert m.score_rows(SeqStep(0, 0, 0, 8, n, True)) == 0  # at most 8 <= 20 resident
    assert m.score_rows(SeqStep(0, 0, 16, 8, n, True)) == 8  # may cut: moving window
    assert m.score_rows(SeqStep(0, 0, 16, 5, n, True)) == 5  # a short chunk: all of it
    assert m.score_rows(SeqStep(0, 0, 16, 8, n, False)) == 0  # unbounded: only votes
    assert m.score_rows(SeqStep(0, 0, 88, 8, n, True)) == 4  # the window's part
    assert m.score_rows(SeqStep(0, 0, 96, 4, n, True)) == 4
    assert m.score_rows(SeqStep(0, 0, 100, 1, n, True)) == 0  # decode


@pytest.mark.parametrize("seed", range(2))
def test_bounded_pyramidkv_cuts_each_layer_to_its_budget(seed):
    layers, chunks = 4, [8] * 12 + [4]
    total = sum(chunks)
    q, k = random_qk(layers, total, seed)
    m = PyramidKV(config("pyramidkv", budget=20, pyramidkv_beta=4.0), layers, HKV)
    budgets = [m.layer_budget(layer) for layer in range(layers)]
    assert len(set(budgets)) == layers
    kept, _, peaks = run(m, q, k, chunks)
    for layer in range(layers):
        ref, gap = ref_bounded_snapkv(
            q[layer], k[layer], chunks, budgets[layer], SINK, RECENT, WINDOW, 1, SCALE
        )
        assert gap > 1e-6, "seed has a near-tie at a cut; pick another"
        assert kept[layer] == ref
        assert max(p[layer] for p in peaks) <= budgets[layer] + 8


def test_no_cut_before_the_last_chunk_is_unbounded_snapkv():
    """Bounded and unbounded agree whenever no chunk before the last leaves a layer above
    its budget (here 40 tokens, chunks 32 + 28): only the prompt-end selection runs."""
    chunks = [32, 28]
    q, k = random_qk(2, 60, 0)
    c = config(budget=40, chunk=32)
    bounded, _, _ = run(SnapKV(c, 2, HKV), q, k, chunks, bounded=True)
    unbounded, _, _ = run(SnapKV(c, 2, HKV), q, k, chunks, bounded=False)
    assert bounded == unbounded
    assert all(len(heads[0]) == 40 for heads in bounded)


def test_a_budget_covering_the_prompt_keeps_everything():
    chunks = [8] * 6
    q, k = random_qk(2, 48, 1)
    kept, asked, _ = run(SnapKV(config(budget=64), 2, HKV), q, k, chunks)
    assert kept == [[list(range(48))] * HKV] * 2
    assert asked[:-1] == [0, 0, 0, 0, 0]  # nothing may be cut: only the window votes


def test_bounded_resident_is_budget_plus_chunk():
    m = SnapKV(config(budget=20, chunk=8), 2, HKV)
    assert m.bounded_resident(1000, 10) == 30  # budget + generated tokens > 20 + 8
    assert m.bounded_resident(1000, 3) == 28  # budget + chunk
    assert m.bounded_resident(12, 3) == 12 + 3  # a prompt within the budget
    assert m.max_resident(1000, 10) == 1000
