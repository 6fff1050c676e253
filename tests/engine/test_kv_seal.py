"""The sealer (engine/kv_seal.py) over a real KVPool and KIVI storage: under any mix of
appends, in-order evictions, per-head compactions and finishes, each view's residual
entries are exactly its trailing `tails` entries, a tail stays below R + G after a step,
residual tokens read back exactly, and once every sequence is gone every residual row
and key group is free again."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.kv_seal import KVSealer
from sparsevllm.kv.format import FormatSizing
from sparsevllm.kv.kivi import KiviStorage
from sparsevllm.kv.registry import get_format
from sparsevllm.sparse.base import SeqStep

HKV, D, SLOTS = 2, 8, 400


def build(group: int, residual: int, groups_table_small: bool = False):
    sizing = FormatSizing(group, residual, max_num_seqs=3, max_step_tokens=40, scratch_rows=0)
    fmt = get_format("int4").sized(sizing)
    storage = fmt.create(SLOTS, HKV, D, torch.float32, torch.device("cpu"))
    assert isinstance(storage, KiviStorage)
    pool = KVPool(SLOTS, 1, [[0]])
    return pool, storage, KVSealer(pool, [storage], group, residual)


def check(pool: KVPool, storage: KiviStorage, sealer: KVSealer, stored: dict) -> None:
    used = 0
    for seq_id, tails in sealer.tails.items():
        if not pool.has(seq_id):
            continue
        view = torch.tensor(pool.table(seq_id, 0), dtype=torch.long)
        residual = storage.state[view] <= -2
        assert int(residual.sum()) == tails[0] == storage.residual_tail(view)
        if tails[0]:
            tail = view[-tails[0] :]
            want = torch.stack([stored[int(s)] for s in tail])
            assert torch.equal(storage.read_keys(tail), want)  # full precision
        used += tails[0]
    assert storage.num_residual_free == storage.kivi.residual_rows - used


def step(pool, storage, sealer, stored, seq_id: int, n: int, rng: torch.Generator) -> None:
    [slots] = pool.append(seq_id, n)
    k = torch.randn(n, HKV, D, generator=rng)
    for s, row in zip(slots, k):
        stored[s] = row
    storage.store(k, k, torch.tensor(slots))
    steps = [SeqStep(seq_id, 0, 0, n, 0)]
    sealer.grow(steps)
    sealer.seal_due(steps)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "evict", "compact", "finish"]),
        st.integers(0, 2),
        st.integers(1, 30),
    ),
    min_size=1,
    max_size=40,
)


@given(st.sampled_from([2, 4, 8]), st.sampled_from([0, 3, 8]), OPS, st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_the_residual_is_always_the_tail_and_everything_comes_back(group, residual, ops, seed):
    pool, storage, sealer = build(group, residual)
    rng = torch.Generator().manual_seed(seed)
    stored: dict[int, torch.Tensor] = {}
    for op, seq_id, n in ops:
        has = pool.has(seq_id)
        if op == "append" and pool.num_free >= n + 1:
            step(pool, storage, sealer, stored, seq_id, n, rng)
            assert sealer.tails[seq_id][0] < residual + group
        elif op == "evict" and has:
            size = pool.num_resident(seq_id)
            keep = sorted(torch.randperm(size, generator=rng)[: max(1, size - n)].tolist())
            pool.replace_view(seq_id, 0, keep)
            sealer.on_keep(seq_id, 0, size, keep)
        elif op == "compact" and has:
            view = torch.tensor(pool.table(seq_id, 0), dtype=torch.long)
            keep = max(1, view.numel() - n)
            pos = torch.stack(
                [
                    torch.randperm(view.numel(), generator=rng)[:keep].sort().values
                    for _ in range(HKV)
                ]
            )
            src = view[pos].t()  # [keep, Hkv]
            moved = [torch.stack([stored[int(s)][h] for h, s in enumerate(row)]) for row in src]
            storage.compact_heads(src, view[:keep])
            stored.update({int(s): row for s, row in zip(view[:keep], moved)})
            pool.truncate_view(seq_id, 0, keep)
            sealer.on_compact(seq_id, 0)
        elif op == "finish" and has:
            sealer.seal_all(seq_id)
            assert sealer.tails[seq_id][0] == 0
            pool.release(seq_id)
            sealer.forget(seq_id)
        check(pool, storage, sealer, stored)
    for seq_id in list(sealer.tails):
        pool.release(seq_id)
        sealer.forget(seq_id)
    assert storage.num_residual_free == storage.kivi.residual_rows
    assert int(storage.group_refs.abs().sum()) == 0


def test_an_exhausted_group_table_is_regrouped_not_failed():
    """Single-token evictions leave groups with one token each; when sealing finds no
    free group the running views are re-grouped (keys re-quantized) and sealing goes on."""
    pool, storage, sealer = build(group=2, residual=0)
    rng = torch.Generator().manual_seed(0)
    stored: dict[int, torch.Tensor] = {}
    table = storage.group_refs.numel()
    for _ in range(350):  # 350 tokens: 175 full groups, 350 if every group kept one
        step(pool, storage, sealer, stored, 0, 2, rng)
        size = pool.num_resident(0)
        if size > 4:  # evict every other token of the newest group: half-empty groups
            keep = [i for i in range(size) if i != size - 2]
            pool.replace_view(0, 0, keep)
            sealer.on_keep(0, 0, size, keep)
        check(pool, storage, sealer, stored)
    assert pool.num_resident(0) > table  # more sealed tokens than groups alone would allow
    referenced = int((storage.group_refs > 0).sum())
    assert referenced <= table
