"""Decode over DeltaKV storage in two phases: rebuild the views densely, then attend.

The fused decode kernel (decode_deltakv.py) rebuilds a tile's compressed keys where it
scores them, so every tile of every split waits on two chains: the W_k chunks of its
latent loop, and five dependent loads (slot, state, references, their rows and
positions, their cos/sin rows). At Llama-3-8B shapes, 32K, batch 1, on an H100 it took
1.33 ms a layer for 30.8 GFLOP of key up-projection (about 2% of the tensor cores' rate;
docs/benchmarks). Here the two halves run apart:

1. the rebuild kernel, one program per (tile of BLOCK_N view positions, sequence, KV
   head), writes the tile's post-RoPE keys and its values in the model dtype to a dense
   scratch `[S x P, Hkv, D]` (row s x P + position): full rows copied, compressed tokens
   rebuilt as `deltakv_tiles.py` defines them. Its programs hold no softmax state, so
   many run per SM and hide those chains behind each other; a tile of full rows only
   (the recent window, the sink) is a copy;
2. the engine's dense decode kernel (decode.py) attends over the scratch through an
   identity slot table, at its byte floor.

The scratch is `S x P x Hkv x D x 2` elements (P: the batch's longest view), so a batch
goes through it in groups of sequences of at most `scratch_bytes` (at least one
sequence); the same allocation serves every group and layer of a step. The values
cost a second up-projection here, where the fused kernel absorbs W_v into its latent
accumulator, and the scratch's bytes are written and read once more: both are small
against the latency the split removes (the count is in docs/benchmarks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import dot_precision
from sparsevllm.attention.triton.decode import decode_attention
from sparsevllm.attention.triton.deltakv_tiles import (
    COMPRESSED,
    DeltaKVTensors,
    compressed_keys,
    compressed_values,
    latent_params,
    rope_args,
    up_project,
)
from sparsevllm.deltakv.rope import RopeTable

# Scratch one group of sequences may hold (K and V, model dtype): 4 sequences of 32K or
# one of 128K at Llama-3-8B shapes.
REBUILD_SCRATCH_BYTES = 512 << 20
# A scratch row holds a multiple of this many positions, so the views' growth by a token
# a step reuses it for many steps.
ROW_QUANTUM = 1024


class RebuildScratch:
    """The rebuilt views' K and V `[G x W, Hkv, D]` and their identity slot table `[G,
    W]` (row s x W + position), kept between calls: a step's layers and the steps after
    it reuse them until a longer view or a wider group needs more (at Llama-3-8B shapes a
    decode step at batch 1 is bound by host work, so each layer's allocations count)."""

    def __init__(self) -> None:
        self._key: tuple[int, int, int, int, torch.dtype, torch.device] | None = None
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(
        self,
        group: int,
        longest: int,
        heads: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V, the identity table and its rows `[G]`, for `group` views of at most
        `longest` positions (the table's row stride is the buffers' W >= longest)."""
        width = row_width(longest)
        have = self._key
        fits = have is not None and have[0] >= group and have[1] >= width
        if not fits or have is None or have[2:] != (heads, dim, dtype, device):
            self._key = (group, width, heads, dim, dtype, device)
            k = torch.empty((group * width, heads, dim), dtype=dtype, device=device)
            ident = torch.arange(group * width, dtype=torch.int32, device=device)
            rows = torch.arange(group, dtype=torch.int32, device=device)
            self._bufs = (k, torch.empty_like(k), ident.view(group, width), rows)
        assert self._bufs is not None
        return self._bufs


def row_width(longest: int) -> int:
    """Positions a scratch row holds for views of at most `longest` (a multiple of
    ROW_QUANTUM)."""
    return -(-max(1, longest) // ROW_QUANTUM) * ROW_QUANTUM


@triton.jit
def _rebuild_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    state_ptr, latent_ptr, refs_ptr, pos_ptr, fk_ptr, fv_ptr, row_pos_ptr, w_ptr, b_ptr,
    cos_ptr, sin_ptr, table_ptr, rows_ptr, lens_ptr, k_out, v_out, num_positions, width,
    stride_ls, stride_rs, stride_fr, stride_w, stride_tr, stride_o,
    HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    PW: tl.constexpr, BITS: tl.constexpr, NREF: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_ROPE: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (tile, sequence, KV head): the tile's K and V rows of the scratch."""
    tile = tl.program_id(0)
    s = tl.program_id(1)
    kvh = tl.program_id(2)
    D: tl.constexpr = 2 * HALF
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    ok = offs_n < tl.load(lens_ptr + s)
    table_row = table_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride_tr
    slot = tl.load(table_row + offs_n, mask=ok, other=0).to(tl.int64)
    st = tl.load(state_ptr + slot, mask=ok, other=-1)
    comp = st == COMPRESSED
    fm = (st >= 0)[:, None]
    fk_head = fk_ptr + kvh * D
    fv_head = fv_ptr + kvh * D
    at_full = st.to(tl.int64)[:, None] * stride_fr + offs_h[None, :]
    num_comp = tl.sum(comp.to(tl.int32), axis=0)
    lat_row = latent_ptr + slot[:, None] * stride_ls  # [BLOCK_N, 1]
    z_scale, z_zero = latent_params(lat_row, comp[:, None], PW, BITS)
    out_at = (s.to(tl.int64) * width + offs_n)[:, None] * stride_o + kvh * D + offs_h[None, :]
    m = ok[:, None]
    # Keys, stored before the values are built: fewer registers live at once.
    k_lo = tl.load(fk_head + at_full, mask=fm, other=0.0)  # [BLOCK_N, HALF]
    k_hi = tl.load(fk_head + at_full + HALF, mask=fm, other=0.0)
    dt = k_lo.dtype
    if num_comp > 0:
        c_lo, c_hi = compressed_keys(
            lat_row, comp, slot, z_scale, z_zero, w_ptr + (kvh * D) * stride_w,
            b_ptr + kvh * D, refs_ptr, fk_head, row_pos_ptr, pos_ptr, cos_ptr, sin_ptr,
            num_positions, stride_w, stride_rs, stride_fr, HALF, PW, BITS, BLOCK_R, NREF,
            HAS_BIAS, HAS_ROPE, DOT_PREC,
        )  # fmt: skip
        k_lo = tl.where(fm, k_lo, c_lo.to(dt))
        k_hi = tl.where(fm, k_hi, c_hi.to(dt))
    tl.store(k_out + out_at, k_lo, mask=m)
    tl.store(k_out + out_at + HALF, k_hi, mask=m)
    v_lo = tl.load(fv_head + at_full, mask=fm, other=0.0)
    v_hi = tl.load(fv_head + at_full + HALF, mask=fm, other=0.0)
    if num_comp > 0:
        b_lo, b_hi = compressed_values(
            refs_ptr, slot, comp, fv_head, b_ptr + HKV * D + kvh * D, stride_rs, stride_fr,
            HALF, NREF, HAS_BIAS,
        )  # fmt: skip
        b_lo, b_hi = up_project(
            b_lo, b_hi, lat_row, comp[:, None], w_ptr + (HKV * D + kvh * D) * stride_w,
            z_scale, z_zero, stride_w, PW, BITS, BLOCK_R, HALF, DOT_PREC,
        )  # fmt: skip
        v_lo = tl.where(fm, v_lo, b_lo.to(dt))
        v_hi = tl.where(fm, v_hi, b_hi.to(dt))
    tl.store(v_out + out_at, v_lo, mask=m)
    tl.store(v_out + out_at + HALF, v_hi, mask=m)


def deltakv_rebuild_attention(
    q: torch.Tensor,  # [S, Hq, D]
    t: DeltaKVTensors,
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32 (incl. the query's own token)
    longest: int,  # >= every view length (host value: sizes the scratch)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    rope: RopeTable | None = None,  # rope_table(t.freqs, P), deltakv/rope.py
    scratch: RebuildScratch | None = None,
    scratch_bytes: int = REBUILD_SCRATCH_BYTES,
    block_n: int = 64,
    block_r: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole view in DeltaKV storage,
    through a rebuilt dense copy of the views (module docstring); writes and returns
    `out`. Arguments as `deltakv_decode_attention`'s, plus `longest`, the scratch's
    positions per sequence, and `scratch`, buffers kept by the caller between calls
    (a fresh one if None); groups of sequences hold at most `scratch_bytes`."""
    num_seqs, _, head_dim = q.shape
    num_kv_heads = t.full_k.shape[1]
    t.check(head_dim)
    if num_seqs == 0:
        return out
    cos, sin = rope_args(t.freqs, rope, table.shape[1], head_dim, q.device)
    per_seq = 2 * row_width(longest) * num_kv_heads * head_dim * t.full_k.element_size()
    group = max(1, min(num_seqs, scratch_bytes // per_seq))
    scratch = scratch if scratch is not None else RebuildScratch()
    k_scr, v_scr, ident, ident_rows = scratch.get(
        group, longest, num_kv_heads, head_dim, t.full_k.dtype, q.device
    )
    width = ident.shape[1]  # the scratch's row stride in positions
    for s0 in range(0, num_seqs, group):
        n = min(group, num_seqs - s0)
        lens = view_lens[s0 : s0 + n]
        _rebuild_kernel[(triton.cdiv(longest, block_n), n, num_kv_heads)](
            t.state, t.latent, t.refs, t.pos, t.full_k, t.full_v, t.row_pos, t.weight,
            t.weight if t.bias is None else t.bias, cos, sin, table, rows[s0 : s0 + n],
            lens, k_scr, v_scr, cos.shape[0], width,
            t.latent.stride(0), t.refs.stride(0), t.full_k.stride(0), t.weight.stride(0),
            table.stride(0), k_scr.stride(0),
            HKV=num_kv_heads, HALF=head_dim // 2, BLOCK_N=block_n, BLOCK_R=block_r,
            PW=t.plane, BITS=t.bits, NREF=t.refs.shape[1], HAS_BIAS=t.bias is not None,
            HAS_ROPE=t.freqs is not None, DOT_PREC=dot_precision(q.dtype),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
        decode_attention(
            q[s0 : s0 + n], k_scr, v_scr, ident[:n, :longest], ident_rows[:n], lens, scale,
            out[s0 : s0 + n],
        )  # fmt: skip
    return out
