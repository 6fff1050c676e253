"""Device slot tables (CPU stands in for the device), the pool's change record they flush
from, and the asynchronous upload helper."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.engine.kv_pool import KVPool, WindowGroup
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.engine.step_plan import table_writes
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


class _Mirror:
    """A pool with device tables kept in sync the way the runner does: each step applies
    the plan's writes, then writes the deferred entries from the slot mapping."""

    def __init__(self, pool: KVPool, num_rows: int, max_len: int) -> None:
        self.pool = pool
        self.rows = SlotRows(pool, num_rows, max_len)
        self.dev = DeviceSlotTables(pool.num_groups, num_rows, max_len, CPU)

    def step(self, seq_ids: list[int], counts: list[int] | None = None) -> list[int]:
        """Flush the views of `seq_ids`, whose step added `counts` tokens (None: one)."""
        row_ids = [self.rows.row(s) for s in seq_ids]
        lens = [[len(v) for v in self.pool.tables[s]] for s in seq_ids]
        writes = table_writes(self.pool, self.rows, seq_ids, row_ids, lens, counts)
        self.dev.apply(writes)
        rows = torch.tensor(row_ids)
        view_lens = torch.tensor(lens).t()  # [G, S]
        groups = range(self.pool.num_groups)
        n = counts or [1] * len(seq_ids)
        new = [self.pool.tables[s][g][-k:] for g in groups for s, k in zip(seq_ids, n)]
        mapping = torch.tensor([x for part in new for x in part]).view(len(groups), -1)
        q_starts = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()])
        self.dev.write_new(rows, view_lens, mapping, None if counts is None else q_starts)
        return writes.deferred

    def assert_mirrors(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            for g in range(self.pool.num_groups):
                view = self.pool.table(s, g)
                assert self.dev.table[g, self.rows.row(s), : len(view)].tolist() == view
                assert self.pool.is_clean(s, g)


def test_decode_step_writes_only_what_the_pool_recorded():
    """A decode step: sequences whose every group grew by one are written on the device
    from the slot mapping; the others (a fresh prompt, a rewritten view) get uploads, and
    every device row equals the pool's view afterwards."""
    pool = KVPool(64, 3, [[0], [1], [2]])
    m = _Mirror(pool, 4, 16)
    _grow(pool, [(0, 5), (1, 3)])
    m.step([0, 1], [5, 3])
    pool.replace_view(1, 2, keep=[0, 2])  # an eviction in group 2 of sequence 1
    assert pool.clean_prefix(1) == [3, 3, 1]  # entry 0 did not move
    _grow(pool, [(0, 1), (1, 1)])
    assert m.step([0, 1]) == [0]  # 1's rewritten view is uploaded
    m.assert_mirrors([0, 1])
    _grow(pool, [(2, 4)])  # a new prompt alone
    assert m.step([2], [4]) == [0]
    m.assert_mirrors([0, 1, 2])


def test_chunk_entries_written_on_the_device_match_the_pool():
    """A step with prefill chunks: sequences whose every view grew by their chunk are
    written from the slot mapping, a rewritten view is uploaded again."""
    pool = KVPool(96, 2, [[0], [1]])
    m = _Mirror(pool, 4, 32)
    _grow(pool, [(0, 6), (1, 5)])
    m.step([0, 1], [6, 5])
    pool.replace_view(1, 1, keep=[1, 3])
    counts = [4, 7, 9]  # a chunk for each: 0 and 1 continue, 2 is a new prompt
    _grow(pool, list(zip([0, 1, 2], counts)))
    assert m.step([0, 1, 2], counts) == [0, 2]
    m.assert_mirrors([0, 1, 2])


def test_every_mutator_marks_what_it_changed():
    """Appends keep the clean prefix; a truncation, a dropped step, a window trim and a
    fresh row lower it: nothing outside the pool invalidates by hand."""
    pool = KVPool(32, 3, [[0], [1]], [WindowGroup([2], 4, 32)])
    m = _Mirror(pool, 2, 16)
    pool.append(5, 10)
    m.step([5], [10])
    pool.append(5, 2)
    assert pool.clean_prefix(5) == [10, 10, 10] and not pool.is_clean(5, 0)
    m.step([5], [2])
    pool.truncate_view(5, 1, 4)  # a per-head compaction keeps the row's prefix
    assert pool.is_clean(5, 1) and pool.used_per_layer() == [12, 4, 12]
    pool.drop_last(5)
    assert pool.clean_prefix(5) == [11, 3, 11] and pool.is_clean(5, 0)
    assert pool.trim(5) == [2]  # the window keeps its last 3: every entry moved
    assert pool.clean_prefix(5)[2] == 0 and len(pool.table(5, 2)) == 3
    pool.append(5, 1)
    assert m.step([5]) == []  # the trimmed window is uploaded whole
    m.assert_mirrors([5])
    m.rows.release(5)  # an idle chain gives its row back; a new row starts over
    m.rows.row(5)
    assert pool.clean_prefix(5) == [0, 0, 0]
    pool.append(5, 1)
    assert m.step([5]) == []
    m.assert_mirrors([5])


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
