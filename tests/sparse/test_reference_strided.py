"""Strided history sampling against a plain reference of its definition.

Reference, at the end of an L-token prompt with budget B < L: keep the first `sink` and
the last `recent` tokens; from the middle [sink, L - recent), the grid sink, sink + s,
sink + 2s, ... (s = `strided_stride`, or for 0 the smallest s whose grid has at most
B - sink - recent tokens, found by trying s = 1, 2, ...), newest first, then the other
middle tokens, newest first, until B tokens are kept. The same tokens for every head.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from eviction_harness import make_method, ref_keep, run_sequence
from sparsevllm.cli import main
from sparsevllm.sparse.strided import StridedKnobs, prune_scores

HKV, D, LAYERS = 2, 4, 2


def ref_strided(length: int, budget: int, sink: int, recent: int, stride: int) -> list[int]:
    middle = list(range(sink, length - recent))
    room = budget - sink - recent
    s = stride
    if s == 0:
        s = 1
        while room > 0 and len([p for p in middle if (p - sink) % s == 0]) > room:
            s += 1
    grid = [p for p in middle if (p - sink) % s == 0]
    rest = [p for p in middle if p not in grid]
    priority = sorted(grid, reverse=True) + sorted(rest, reverse=True)
    return ref_keep(priority, length, budget, sink, recent)


def run(length, budget, sink, recent, stride, chunks):
    keys = [torch.randn(sum(chunks), HKV, D) for _ in range(LAYERS)]
    knobs = dict(decode_keep_tokens=budget, sink_keep_tokens=sink, recent_keep_tokens=recent)
    m = make_method("strided", LAYERS, HKV, strided_stride=stride, **knobs)
    return run_sequence(m, keys, keys, chunks, length)


@pytest.mark.parametrize(
    "length, budget, sink, recent, stride",
    [
        (61, 24, 4, 8, 0),  # auto: stride ceil(49 / 12) = 5, 10 grid tokens + 2 newest others
        (60, 20, 2, 4, 0),  # auto: 54 middle tokens in a room of 14 -> stride 4, 14 on the grid
        (50, 16, 0, 0, 0),
        (40, 39, 4, 4, 0),  # a room of 31 for 32 middle tokens: stride 2
        (61, 24, 4, 8, 3),  # a fixed stride too fine: its newest 12 grid tokens
        (61, 24, 4, 8, 9),  # a fixed stride too coarse: 6 on the grid + the 6 newest others
        (61, 12, 4, 8, 0),  # no room for the middle
        (30, 30, 4, 8, 2),  # the budget covers the prompt: everything
    ],
)
def test_strided_matches_reference(length, budget, sink, recent, stride):
    kept, resident = run(length, budget, sink, recent, stride, [length])
    ref = ref_strided(length, budget, sink, recent, stride)
    assert resident[-1] == [len(ref)] * LAYERS
    for layer in range(LAYERS):
        assert kept[layer].tolist() == [ref] * HKV, layer


def test_strided_selects_once_at_prompt_end_whatever_the_chunks():
    ref = ref_strided(45, 20, 4, 4, 0)
    for chunks in ([45], [7] * 6 + [3], [44, 1]):
        kept, resident = run(45, 20, 4, 4, 0, [*chunks, 1, 1])
        assert [r[0] for r in resident[-3:]] == [20, 21, 22]  # decode appends, never evicts
        assert kept[0][0].tolist() == [*ref, 45, 46]


def ref_prune_order(positions: list[int], stride: int) -> list[int]:
    """Entry indices from the first kept to the last: the grid (p % s == 0), or for 0
    the largest power of two dividing p (0 divides by all), then the newer first."""

    def level(p: int) -> int:
        if stride > 0:
            return int(p % stride == 0)
        if p == 0:
            return 99
        k = 0
        while p % 2 ** (k + 1) == 0:
            k += 1
        return k

    return sorted(range(len(positions)), key=lambda j: (-level(positions[j]), -positions[j]))


@pytest.mark.parametrize("stride", [0, 3, 5])
def test_strided_prune_ranks_match_reference(stride):
    g = torch.Generator().manual_seed(stride)
    # Per-head histories after an earlier per-head eviction: ascending, different.
    positions = torch.stack(
        [torch.randperm(200, generator=g)[:60].sort().values for _ in range(HKV)]
    )
    positions[0, 0] = 0
    got = prune_scores(torch.zeros(60, HKV, D), positions, StridedKnobs(strided_stride=stride))
    for h in range(HKV):
        order = got[h].argsort(descending=True).tolist()
        assert order == ref_prune_order(positions[h].tolist(), stride), h
    assert got.dtype == torch.float32 and sorted(got[0].tolist()) == list(range(60))


def test_strided_knob_bounds_and_listing():
    with pytest.raises(ValueError, match="strided_stride must be >= 0"):
        StridedKnobs(strided_stride=-1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["methods", "--json"]) == 0
    row = {r["name"]: r for r in json.loads(out.getvalue())}["strided"]
    assert row["family"] == "physical_eviction" and row["prune"] and row["chain_cache"]
    assert row["knobs"]["strided_stride"] == 0 and row["budget_knob"] == "decode_keep_tokens"
