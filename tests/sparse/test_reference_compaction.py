"""Per-KV-head compaction (`RunnerKV.keep_per_head`) and per-head reads (`gather_selected`)
against plain per-head references.

After `keep_per_head(positions [Hkv, B])`, row j of the sequence's view must hold, for
every KV head h, the K and V of head h's j-th selected token; the other slots return to
the pool; and GQA attention over the compacted view (`attend`) must equal attention
computed head by head over that head's own selected tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsevllm.attention.torch_ref import attend, gather_selected
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage

HQ, HKV, D, LAYERS, SLOTS = 8, 2, 16, 3, 96
SCALE = 1.0 / math.sqrt(D)


def ref_attention(q: torch.Tensor, k_per_head: list, v_per_head: list) -> torch.Tensor:
    """One query `[Hq, D]`; head h's keys/values `[n_h, D]` (float64): `[Hq, D]`."""
    group = HQ // HKV
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for qh in range(HQ):
        k, v = k_per_head[qh // group], v_per_head[qh // group]
        logits = [float(k[j] @ q[qh]) * SCALE for j in range(len(k))]
        top = max(logits)
        w = [math.exp(x - top) for x in logits]
        for j in range(len(k)):
            out[qh] += w[j] / sum(w) * v[j]
    return out


def make(seed: int):
    """A pool with one group per layer, random caches, and two interleaved sequences."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, LAYERS, [[la] for la in range(LAYERS)])
    k_cache = [torch.randn(SLOTS, HKV, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    v_cache = [torch.randn(SLOTS, HKV, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    # Interleave so the target sequence's slots are not contiguous.
    pool.append(1, 5)
    pool.append(2, 20)
    pool.append(1, 7)
    pool.append(2, 17)
    storage = [DenseStorage.wrap(k, v) for k, v in zip(k_cache, v_cache)]
    return pool, k_cache, v_cache, RunnerKV(pool, storage), g


def random_positions(g: torch.Generator, length: int, keep: int) -> torch.Tensor:
    """Ascending positions per KV head, not the same for every head."""
    while True:
        rows = [torch.randperm(length, generator=g)[:keep].sort().values for _ in range(HKV)]
        if not all(torch.equal(r, rows[0]) for r in rows):
            return torch.stack(rows)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("keep", [1, 10, 36])
def test_keep_per_head_compacts_exactly(seed, keep):
    pool, k_cache, v_cache, kv, g = make(seed)
    layer, length = 1, 37
    assert kv.resident(2, layer) == length
    table = list(pool.table(2, layer))
    before_k = [c.clone() for c in k_cache]
    before_v = [c.clone() for c in v_cache]
    k_view, v_view = k_cache[layer][table].clone(), v_cache[layer][table].clone()
    other_tables = {(s, la): list(pool.table(s, la)) for s in (1, 2) for la in range(LAYERS)}
    used = pool.used_per_layer()
    positions = random_positions(g, length, keep)

    kv.keep_per_head(2, layer, positions)

    new = pool.table(2, layer)
    assert new == table[:keep]  # the first `keep` slots of the view become the rows
    for h in range(HKV):
        for j in range(keep):
            src = int(positions[h, j])
            assert torch.equal(k_cache[layer][new[j], h], k_view[src, h]), (h, j)
            assert torch.equal(v_cache[layer][new[j], h], v_view[src, h]), (h, j)
    assert torch.equal(kv.keys(2, layer)[:, 0], k_view[positions[0], 0])
    for h in range(HKV):  # reads follow the compaction, per head
        assert torch.equal(kv.values(2, layer)[:, h], v_view[positions[h], h])
        assert torch.equal(kv.values(2, layer, 1, 3)[:, h], v_view[positions[h, 1:3], h])
    # The dropped slots were freed in this layer's group only.
    expected = list(used)
    expected[layer] -= length - keep
    assert pool.used_per_layer() == expected
    assert pool.num_resident(2, pool.group_of_layer[layer]) == keep
    # Nothing else moved: other layers, and the other sequence's slots in this layer.
    for (s, la), tab in other_tables.items():
        if (s, la) != (2, layer):
            assert pool.table(s, la) == tab
            assert torch.equal(k_cache[la][tab], before_k[la][tab])
            assert torch.equal(v_cache[la][tab], before_v[la][tab])
    # Attention over the compacted view == per-head attention over each head's tokens.
    q = torch.randn(1, HQ, D, generator=g, dtype=torch.float64)
    view = torch.tensor(new)
    got = attend(q, k_cache[layer][view], v_cache[layer][view], SCALE)[0]
    ref = ref_attention(
        q[0],
        [k_view[positions[h], h] for h in range(HKV)],
        [v_view[positions[h], h] for h in range(HKV)],
    )
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    # The freed slots are handed out again.
    assert len(pool.append(3, length - keep)[layer]) == length - keep


def test_keep_per_head_same_positions_for_every_head():
    pool, k_cache, v_cache, kv, g = make(7)
    layer = 2
    table = list(pool.table(2, layer))
    k_view = k_cache[layer][table].clone()
    positions = random_positions(g, 37, 12)[0].expand(HKV, 12)
    used = pool.used_per_layer()
    kv.keep_per_head(2, layer, positions)
    assert torch.equal(kv.keys(2, layer), k_view[positions[0]])
    assert pool.used_per_layer()[layer] == used[layer] - 25


def test_keep_per_head_needs_one_group_per_layer():
    pool = KVPool(16, 2, [[0, 1]])
    caches = [torch.zeros(16, HKV, D) for _ in range(2)]
    pool.append(0, 8)
    with pytest.raises(RuntimeError):
        RunnerKV(pool, [DenseStorage.wrap(c, c) for c in caches]).keep_per_head(
            0, 0, torch.tensor([[0, 1], [0, 2]])
        )


@pytest.mark.parametrize("seed", range(3))
def test_gather_selected_reads_each_heads_tokens_plus_the_new_one(seed):
    pool, k_cache, v_cache, _, g = make(seed)
    layer = 0
    view = torch.tensor(pool.table(2, layer))  # 37 rows; the last is the new token
    k_view, v_view = k_cache[layer][view], v_cache[layer][view]
    q = torch.randn(1, HQ, D, generator=g, dtype=torch.float64)
    # Per head.
    positions = random_positions(g, 36, 9)
    k_sel, v_sel = gather_selected(
        DenseStorage.wrap(k_cache[layer], v_cache[layer]), view, positions
    )
    assert k_sel.shape == (10, HKV, D)
    for h in range(HKV):
        assert torch.equal(k_sel[:9, h], k_view[positions[h], h])
        assert torch.equal(v_sel[:9, h], v_view[positions[h], h])
    assert torch.equal(k_sel[9], k_view[-1]) and torch.equal(v_sel[9], v_view[-1])
    got = attend(q, k_sel, v_sel, SCALE)[0]
    rows = [positions[h].tolist() + [36] for h in range(HKV)]
    ref = ref_attention(
        q[0], [k_view[rows[h], h] for h in range(HKV)], [v_view[rows[h], h] for h in range(HKV)]
    )
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    # Shared across heads.
    shared = positions[0]
    k_sel, v_sel = gather_selected(DenseStorage.wrap(k_cache[layer], v_cache[layer]), view, shared)
    rows = shared.tolist() + [36]
    assert torch.equal(k_sel, k_view[rows]) and torch.equal(v_sel, v_view[rows])
