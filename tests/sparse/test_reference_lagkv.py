"""LagKV against a plain reference of its definition (float64, Python loops).

Reference, per layer and KV head at the end of an L-token prompt (S = sink, W = lag):
partitions P_i = [S + iW, S + (i+1)W) for i < n = (L - S) // W; each P_i with a
successor is scored against P_{i+1}: for K and for V, a channel's reference range is
its min..max over P_{i+1}, token t's deviation is the sample standard deviation over
channels of (x_c - min_c) / (max_c - min_c), and its score is the softmax of the
deviations over P_i, summed for K and V. The last full partition and the remainder
(the lag tail) come first, newest first; then the scored tokens by their rank inside
their partition (best first), then by score. The first `sink` and the last `recent`
tokens are always kept, `decode_keep_tokens` in all. The method runs on the real KV
storage, which it reads back K and V from (`eviction_harness.run_sequence`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from eviction_harness import make_method, ref_keep, run_sequence
from sparsevllm.cli import main
from sparsevllm.sparse.lagkv import LagKVKnobs, lag_softmax, prune_scores

HKV, D, LAYERS = 2, 6, 2


def ref_deviation_softmax(x: torch.Tensor, head: int, cur: range, ref: range) -> list[float]:
    """Softmax over `cur` of each token's deviation from `ref`'s per-channel range."""
    lo = [min(float(x[t, head, c]) for t in ref) for c in range(D)]
    hi = [max(float(x[t, head, c]) for t in ref) for c in range(D)]
    devs = []
    for t in cur:
        z = [(float(x[t, head, c]) - lo[c]) / max(hi[c] - lo[c], 1e-6) for c in range(D)]
        mean = sum(z) / D
        devs.append(math.sqrt(sum((v - mean) ** 2 for v in z) / (D - 1)))
    top = max(devs)
    e = [math.exp(d - top) for d in devs]
    return [v / sum(e) for v in e]


def ref_priority(k, v, head: int, length: int, sink: int, lag: int) -> list[int]:
    """Every position from the first to be kept to the last (sink first)."""
    n = (length - sink) // lag if length > sink else 0
    tail_start = sink + (n - 1) * lag if n >= 1 else sink
    scored = []  # (rank, score, position)
    for i in range(n - 1):
        cur = range(sink + i * lag, sink + (i + 1) * lag)
        ref = range(sink + (i + 1) * lag, sink + (i + 2) * lag)
        s = ref_deviation_softmax(k, head, cur, ref)
        if v is not None:
            s = [a + b for a, b in zip(s, ref_deviation_softmax(v, head, cur, ref))]
        ranked = sorted(range(lag), key=lambda j: s[j])  # lowest score: rank 0
        for rank, j in enumerate(ranked):
            scored.append((rank, s[j], cur[j]))
    scored.sort(key=lambda e: (-e[0], -e[1], -e[2]))
    tail = list(range(length - 1, tail_start - 1, -1))
    return [*range(sink), *tail, *[p for _, _, p in scored]]


def random_kv(seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(length, HKV, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    values = [torch.randn(length, HKV, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    return keys, values


CASES = [
    # length, budget, sink, recent, lag: 9 partitions of 6 (8 scored), 3 left over
    (61, 24, 4, 8, 6),
    (61, 40, 4, 2, 6),  # room for several tokens of every partition
    (50, 20, 0, 0, 8),  # 6 partitions, a tail of 10 tokens
    (48, 16, 2, 4, 4),  # no remainder: the tail is exactly the last partition
    (30, 16, 4, 4, 16),  # shorter than S + 2W: no scored partition, the newest are kept
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("length, budget, sink, recent, lag", CASES)
def test_lagkv_matches_reference_per_kv_head(seed, length, budget, sink, recent, lag):
    keys, values = random_kv(seed, length)
    knobs = dict(decode_keep_tokens=budget, sink_keep_tokens=sink, recent_keep_tokens=recent)
    m = make_method("lagkv", LAYERS, HKV, lagkv_lag_size=lag, **knobs)
    kept, resident = run_sequence(m, keys, values, [length], length)
    assert resident == [[budget] * LAYERS]
    for layer in range(LAYERS):
        for h in range(HKV):
            priority = ref_priority(keys[layer], values[layer], h, length, sink, lag)
            assert sorted(priority) == list(range(length))
            ref = ref_keep(priority, length, budget, sink, recent)
            assert kept[layer][h].tolist() == ref, (layer, h)


def test_lagkv_values_count_and_chunks_do_not():
    """The same keys with other values choose other tokens; the chunking changes nothing."""
    keys, values = random_kv(11, 61)
    _, other = random_kv(12, 61)
    m = make_method(
        "lagkv", LAYERS, HKV, decode_keep_tokens=24, recent_keep_tokens=4, lagkv_lag_size=6
    )
    base, _ = run_sequence(m, keys, values, [61], 61)
    swapped, _ = run_sequence(m, keys, other, [61], 61)
    assert any(not torch.equal(a, b) for a, b in zip(base, swapped))
    chunked, resident = run_sequence(m, keys, values, [7] * 8 + [5], 61)
    assert resident[-2] == [56] * LAYERS and resident[-1] == [24] * LAYERS
    assert all(torch.equal(a, b) for a, b in zip(base, chunked))


def test_lagkv_budget_covering_the_prompt_keeps_everything():
    keys, values = random_kv(3, 40)
    m = make_method(
        "lagkv", LAYERS, HKV, decode_keep_tokens=40, recent_keep_tokens=4, lagkv_lag_size=4
    )
    kept, resident = run_sequence(m, keys, values, [30, 8, 1, 1], 38)
    assert [r[0] for r in resident] == [30, 38, 39, 40]
    assert all(k.tolist() == [list(range(40))] * HKV for k in kept)


def test_lagkv_prune_scores_keys_only_from_the_first_entry():
    keys, _ = random_kv(4, 27)
    positions = torch.arange(100, 127).expand(HKV, 27)  # not read: entries are partitioned
    got = prune_scores(keys[0], positions, LagKVKnobs(lagkv_lag_size=5))
    for h in range(HKV):
        order = got[h].argsort(descending=True).tolist()
        assert order == ref_priority(keys[0], None, h, 27, 0, 5), h
    assert got.dtype == torch.float32 and sorted(got[0].tolist()) == list(range(27))


def test_lagkv_constant_reference_channel_stays_finite():
    keys, _ = random_kv(5, 20)
    keys[0][5:10, :, 2] = 0.5  # one channel without range in partition 1 (a reference)
    s = lag_softmax(keys[0][:15], 2, 5)  # partitions 0 and 1 against 1 and 2
    assert torch.isfinite(s).all()


def test_lagkv_knob_bounds_and_listing():
    with pytest.raises(ValueError, match="lagkv_lag_size must be >= 2"):
        LagKVKnobs(lagkv_lag_size=1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["methods", "--json"]) == 0
    row = {r["name"]: r for r in json.loads(out.getvalue())}["lagkv"]
    assert row["family"] == "physical_eviction" and row["prune"] and row["chain_cache"]
    assert row["knobs"]["lagkv_lag_size"] == 128 and row["budget_knob"] == "decode_keep_tokens"
