"""Device slot tables (CPU stands in for the device) and the asynchronous upload helper."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.upload import upload

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "dtype, values",
    [(torch.int64, [3, -1, 2**40]), (torch.int32, [7, 0, -5]), (torch.float32, [0.5, 2.0])],
)
def test_upload_keeps_values_and_dtype(dtype, values):
    t = upload(values, dtype, CPU)
    assert t.dtype == dtype and t.tolist() == values
    assert upload([], dtype, CPU).shape == (0,)


def test_upload_refuses_values_the_dtype_cannot_hold():
    with pytest.raises(OverflowError):
        upload([2**40], torch.int32, CPU)


def _grow(pool: KVPool, steps: list[tuple[int, int]]) -> None:
    for seq_id, n in steps:
        pool.append(seq_id, n)


def test_deferred_newest_entries_match_the_full_upload():
    """A decode step: sequences whose every group grew by one are written on the device
    (write_new) and the table equals the one sync alone uploads; the others (a fresh
    prompt, a rewritten view) still go through the upload."""
    tables = {}
    for deferring in (False, True):
        pool = KVPool(64, 3, [[0], [1], [2]])
        t = DeviceSlotTables(pool, 4, 16, CPU)
        _grow(pool, [(0, 5), (1, 3)])
        t.sync([0, 1])
        pool.replace_view(1, 2, keep=[0, 2])  # an eviction in group 2 of sequence 1
        t.rewrite(1, 2)
        _grow(pool, [(0, 1), (1, 1), (2, 4)])  # 0 and 1 decode, 2 is a new prompt
        seq_ids = [0, 1, 2]
        if not deferring:
            assert t.sync(seq_ids) == []
        else:
            lens = [[len(view) for view in pool.tables[s]] for s in seq_ids]
            deferred = t.sync(seq_ids, lens)
            assert deferred == [0, 1]
            rows = torch.tensor([t.row(s) for s in seq_ids])
            view_lens = torch.tensor(lens).t()  # [G, S]
            newest = torch.tensor([[view[-1] for view in pool.tables[s]] for s in seq_ids]).t()
            t.write_new(rows, view_lens, newest)
        tables[deferring] = t.table.clone()
        for s in seq_ids:  # the device rows hold the pool's views
            for g in range(3):
                view = pool.table(s, g)
                assert t.table[g, t.row(s), : len(view)].tolist() == view
    assert torch.equal(tables[False], tables[True])


def test_shuffled_slots_give_the_same_tokens(tiny_model_factory):
    """Where the pool puts a token's KV changes no result (kv_slot_order)."""
    from sparsevllm import LLM, SamplingParams

    model = tiny_model_factory("llama")
    prompts = [[1] + list(range(10 + 3 * i, 40 + 5 * i)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for order in ("sequential", "shuffled"):
        llm = LLM(
            model,
            dtype="float32",
            kv_slot_order=order,
            sparse_method="snapkv",
            decode_keep_tokens=16,
            recent_keep_tokens=4,
        )
        outs[order] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        first = llm.engine.pool.append(10**6, 8)[0]  # the next free slots, in order
        assert (first == list(range(first[0], first[0] + 8))) == (order == "sequential")
    assert outs["sequential"] == outs["shuffled"]


def test_truncated_views_keep_their_device_prefix():
    """A per-head compaction keeps a view's first n entries: the pool frees the tail at
    once and the device row needs no upload (synced_view is its prefix); entries not
    yet uploaded are not offered as a synced view."""
    pool = KVPool(32, 2, [[0], [1]])
    t = DeviceSlotTables(pool, 2, 16, CPU)
    pool.append(5, 10)
    t.sync([5])
    before = pool.table(5, 1)
    assert t.synced_view(5, 1).tolist() == before
    pool.truncate_view(5, 1, 4)
    t.truncate(5, 1, 4)
    assert pool.table(5, 1) == before[:4] and pool.used_per_layer() == [10, 4]
    assert t.synced_view(5, 1).tolist() == before[:4]
    assert t.sync([5]) == [] and t.synced_view(5, 0).tolist() == pool.table(5, 0)
    pool.append(5, 2)  # new entries: the row lags until the next sync
    assert t.synced_view(5, 1) is None and t.synced_view(7, 0) is None
    t.sync([5])
    assert t.synced_view(5, 1).tolist() == pool.table(5, 1)
    assert pool.used_per_layer() == [12, 6]


def test_chunk_entries_written_on_the_device_match_the_full_upload():
    """A step with prefill chunks: sequences whose every view grew by their chunk are
    written from the slot mapping (write_new); the table equals the one sync alone
    uploads, including a sequence whose view was rewritten (uploaded as before)."""
    tables = {}
    for deferring in (False, True):
        pool = KVPool(96, 2, [[0], [1]])
        t = DeviceSlotTables(pool, 4, 32, CPU)
        _grow(pool, [(0, 6), (1, 5)])
        t.sync([0, 1])
        pool.replace_view(1, 1, keep=[1, 3])
        t.invalidate(1, 1)  # rewritten: uploaded whole at the next sync
        counts = [4, 7, 9]  # a chunk for each: 0 and 1 continue, 2 is a new prompt
        _grow(pool, list(zip([0, 1, 2], counts)))
        seq_ids = [0, 1, 2]
        lens = [[len(view) for view in pool.tables[s]] for s in seq_ids]
        if not deferring:
            assert t.sync(seq_ids) == []
        else:
            assert t.sync(seq_ids, lens, counts) == [0, 2]
            rows = torch.tensor([t.row(s) for s in seq_ids])
            slots = [
                view[g][-n:]
                for g in range(2)
                for view, n in zip((pool.tables[s] for s in seq_ids), counts)
            ]
            mapping = torch.tensor([x for part in slots for x in part]).view(2, -1)  # [G, T]
            q_starts = torch.tensor([0, 4, 11, 20])
            t.write_new(rows, torch.tensor(lens).t(), mapping, q_starts)
        tables[deferring] = t.table.clone()
        for s in seq_ids:
            for g in range(2):
                view = pool.table(s, g)
                assert t.table[g, t.row(s), : len(view)].tolist() == view
    assert torch.equal(tables[False], tables[True])
