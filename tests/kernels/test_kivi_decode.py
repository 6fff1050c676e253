"""The KIVI decode kernel (attention/triton/decode_kivi.py) against float64 attention over
the torch reference's dequantized reads (`KiviStorage.read`), on views that mix tiles
of one sealed key group (the fast loop), tiles spanning groups, residual tails,
re-grouped (compacted) entries and empty views; and where the fast loop ends.

Shapes are tiny: under TRITON_INTERPRET=1 these run on the CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention import torch_ref  # noqa: E402
from sparsevllm.attention.triton.decode_kivi import (  # noqa: E402
    kivi_decode_attention,
    kivi_tile_plan,
)
from sparsevllm.kv.format import FormatSizing  # noqa: E402
from sparsevllm.kv.registry import get_format  # noqa: E402

HEAD_DIM, G = 64, 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def build(name: str, dtype: torch.dtype, lens: list[int], num_kv_heads: int, seed: int):
    """A KIVI storage holding `len(lens)` views; each view's leading entries are sealed in
    order (G to a group), some views are compacted per head, the rest stay residual."""
    gen = torch.Generator().manual_seed(seed)
    sizing = FormatSizing(G, 4, max_num_seqs=len(lens), max_step_tokens=sum(lens), scratch_rows=0)
    num_slots = sum(lens) + 9
    storage = (
        get_format(name)
        .sized(sizing)
        .create(num_slots, num_kv_heads, HEAD_DIM, dtype, torch.device("cpu"))
    )
    free = torch.randperm(num_slots - 1, generator=gen) + 1  # slot 0 pads the table
    table = torch.zeros(len(lens) + 2, max(lens) + 3, dtype=torch.int32)
    rows = torch.randperm(table.shape[0], generator=gen)[: len(lens)].to(torch.int32)
    offset = 0
    for i, (row, n) in enumerate(zip(rows.tolist(), lens)):
        slots = free[offset : offset + n]
        offset += n
        kv = torch.randn(2, n, num_kv_heads, HEAD_DIM, generator=gen)
        kv[0, :, :, 5] *= 12.0  # an outlier key channel
        storage.store(kv[0].to(dtype), kv[1].to(dtype), slots)
        sealed = (n - 4) // G * G if n > 4 else 0  # R = 4 residual at the end
        if sealed:
            storage.seal(slots[:sealed].view(-1, G))
        if i % 3 == 2 and n > 6:  # per-head compaction: misaligned, re-grouped tiles
            keep = n - 3
            pos = torch.stack(
                [torch.randperm(n, generator=gen)[:keep].sort().values for _ in range(num_kv_heads)]
            )
            storage.compact_heads(slots[pos].t(), slots[:keep])
            storage.release(slots[keep:])
            n, slots = keep, slots[:keep]
            lens[i] = keep
        table[row, :n] = slots.to(torch.int32)
    return storage, table, rows, torch.tensor(lens, dtype=torch.int32)


def reference(q, storage, table, rows, lens, scale) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        n = int(lens[s])
        if n == 0:
            continue
        k, v = storage.read(table[int(rows[s]), :n].long())
        out[s] = torch_ref.attend(q[s : s + 1].double(), k.double(), v.double(), scale)[0]
    return out


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,num_splits", [((4, 2), 1), ((8, 2), 3), ((3, 1), 2)])
@pytest.mark.parametrize(
    "variant",
    [{}, {"dequant_keys": False}],
    ids=["dequant-keys", "scaled-query"],
)
def test_kivi_decode_equals_the_reference_over_dequantized_reads(
    name, dtype, heads, num_splits, variant
):
    num_q_heads, num_kv_heads = heads
    lens = [1, 5, 19, 40, 71, 0, 33]
    storage, table, rows, lens_t = build(name, dtype, lens, num_kv_heads, seed=num_splits)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens), num_q_heads, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    ref = reference(q, storage, table, rows, lens_t, scale)
    dev = {n: t.to(DEVICE) for n, t in storage.buffers().items()}
    out = torch.empty_like(q, device=DEVICE)
    kivi_decode_attention(
        q.to(DEVICE),
        dev["k"],
        dev["v"],
        dev["v_params"],
        dev["state"],
        storage.key_groups.to(DEVICE),
        storage.res_k.to(DEVICE),
        storage.res_v.to(DEVICE),
        table.to(DEVICE),
        rows.to(DEVICE),
        lens_t.to(DEVICE),
        scale,
        out,
        bits=storage.bits,
        num_splits=num_splits,
        block_n=16,
        **variant,
    )
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert float(err) < TOL[dtype]
    assert torch.equal(out[lens_t == 0].cpu(), torch.zeros_like(out[lens_t == 0].cpu()))


def expected_fast_len(state: torch.Tensor, view: torch.Tensor, block_n: int) -> int:
    """Leading entries of `view` in tiles of `block_n` whose entries share one key group."""
    st = state[view.long()].tolist()
    for j in range(0, len(st), block_n):
        tile = st[j : j + block_n]
        if min(tile) < 0 or min(tile) != max(tile):
            return j
    return len(st)


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("block_n", [16, 32])
def test_fast_loop_covers_the_leading_one_group_tiles(name, block_n):
    lens = [1, 5, 19, 40, 71, 0, 33, 64]
    storage, table, rows, lens_t = build(name, torch.float32, lens, 2, seed=block_n)
    fast, tile_group = kivi_tile_plan(
        storage.state.to(DEVICE), table.to(DEVICE), rows.to(DEVICE), lens_t.to(DEVICE), block_n
    )
    got = fast.cpu()
    want = [
        expected_fast_len(storage.state, table[int(r), : int(n)], block_n)
        for r, n in zip(rows, lens_t)
    ]
    assert got.tolist() == want
    for i, (r, n) in enumerate(zip(rows.tolist(), want)):  # each fast tile's key group
        state = storage.state[table[r, :n].long()]
        assert (
            tile_group[i, : n // block_n].cpu().tolist()
            == state[::block_n][: n // block_n].tolist()
        )
    # Views sealed in order with G = 16 keep their sealed tiles in the fast loop.
    assert block_n != G or any(0 < w for w in want)
