"""DeltaKV storage's full rows (kv/deltakv.py) under any mix of stores (with padded
slots), compressions (some of tokens that are not full any more), frees and a
gather/scatter round trip: every row's reference count is the number of slots that own
it or refer to it, the free stack holds exactly the rows nobody holds (each once),
full tokens read back what was stored, and once every slot is freed every row is free."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.kv.deltakv import COMPRESSED, DeltaKVStorage, deltakv_format

HKV, D, SLOTS, NREF, CODE = 2, 4, 40, 2, 6


def build() -> DeltaKVStorage:
    fmt = dataclasses.replace(deltakv_format(CODE, NREF, 4, 0), fixed_rows=SLOTS)
    return DeltaKVStorage(fmt, SLOTS, HKV, D, torch.float32, torch.device("cpu"))


def check(storage: DeltaKVStorage, stored: dict[int, torch.Tensor]) -> None:
    state = storage.state.long()
    expected = torch.zeros(storage.num_rows, dtype=torch.int32)
    own = state[state >= 0]
    expected.index_add_(0, own, torch.ones_like(own, dtype=torch.int32))
    refs = storage.refs[state == COMPRESSED].reshape(-1).long()
    expected.index_add_(0, refs, torch.ones_like(refs, dtype=torch.int32))
    assert torch.equal(storage.row_refs[: storage.num_rows], expected)
    top = int(storage.free_rows.top)
    free = storage.free_rows.ids[:top].tolist()
    assert len(free) == len(set(free)), "a row is on the free stack twice"
    assert sorted(free) == (expected == 0).nonzero().flatten().tolist()
    assert storage.free_rows.ran_dry() == 0
    for slot, k in stored.items():
        if int(state[slot]) >= 0:
            assert torch.equal(storage.read_full(torch.tensor([slot]))[0][0], k)


def kv(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HKV, D, generator=torch.Generator().manual_seed(seed))


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "compress", "free", "move"]),
        st.lists(st.integers(-1, SLOTS - 1), min_size=1, max_size=8),
        st.integers(0, 2**16),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_rows_are_counted_and_given_back_exactly_once(steps) -> None:
    storage = build()
    stored: dict[int, torch.Tensor] = {}
    for op, picks, seed in steps:
        slots = torch.tensor(list(dict.fromkeys(picks)))  # unique; -1 pads a store
        real = slots[slots >= 0]
        if op == "store":
            k = kv(len(slots), seed)
            storage.store(k, -k, slots)
            stored.update({int(s): k[i] for i, s in enumerate(slots.tolist()) if s >= 0})
        elif op == "compress" and len(real) > NREF:
            refs, toks = real[:NREF], real[NREF:]
            if bool((storage.state[refs] >= 0).all()):  # references are full tokens
                codes = torch.full((len(toks), CODE), seed % 256, dtype=torch.uint8)
                ref_slots = refs.expand(len(toks), NREF)
                storage.compress(toks, toks, codes, ref_slots, ref_slots)
        elif op == "free" and len(real):
            storage.release(real)
            for s in real.tolist():
                stored.pop(s, None)
        elif op == "move" and len(real):
            held = real[storage.state[real] != -1]
            if len(held):
                storage.scatter_rows(held, storage.gather_rows(held))
        check(storage, stored)
    storage.release(torch.arange(SLOTS))
    assert storage.num_rows_free == storage.num_rows


def test_compress_leaves_tokens_that_are_not_full_as_they_are() -> None:
    storage = build()
    storage.store(kv(6, 0), kv(6, 1), torch.arange(6))
    refs = torch.tensor([[0, 1]] * 2)
    codes = torch.full((2, CODE), 7, dtype=torch.uint8)
    storage.compress(torch.tensor([2, 3]), torch.tensor([2, 3]), codes, refs, refs)
    before = {name: buf.clone() for name, buf in storage.buffers().items()}
    rows_before = storage.row_refs.clone()
    # Slot 2 is compressed already; slot 4 refers to slot 3, which is not a full token.
    storage.compress(
        torch.tensor([2, 4]),
        torch.tensor([2, 4]),
        torch.full((2, CODE), 9, dtype=torch.uint8),
        torch.tensor([[0, 1], [0, 3]]),
        torch.tensor([[0, 1], [0, 3]]),
    )
    for name, buf in storage.buffers().items():
        assert torch.equal(buf, before[name]), name
    assert torch.equal(storage.row_refs, rows_before)
