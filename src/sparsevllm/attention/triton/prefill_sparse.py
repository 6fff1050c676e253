"""Block-sparse causal prefill attention over a slot table, and its pattern estimation.

`prefill_sparse_attention` is prefill.py's `_prefill_kernel` (the same slot-table
addressing, fp32 online softmax in base 2, causal mask on the diagonal tiles, GQA by one
query head per program) for ONE sequence's chunk, except that query block mb of head h
walks only the key blocks `block_index[h // G, mb, :block_count[h // G, mb]]`
(attention/sparse_prefill.py builds them). The list is ascending and holds every key
block the block's diagonal touches, so the tiles before `full_end` (visible to every row)
come first and run unmasked, and the rest are exactly the diagonal tiles, masked.
Model-dtype caches only: the backend keeps quantized formats on the dense kernel.

`block_mass` is the estimation's only pass over the view: the last R queries' logits
against every key block (QK^T only, no V), reduced per (head, row, key block) to a max
and a sum of exponentials; the softmax over the view is then a small torch reduction of
those [Hq, R, nkb] pairs, so no [Hq, R, L] logits tensor is ever materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.sparse_prefill import BLOCK_M, BLOCK_N
from sparsevllm.attention.triton._common import (
    LOG2E,
    check_attention_args,
    dot_precision,
    next_pow2,
)
from sparsevllm.attention.triton.prefill_tile import prefill_tile_step

# Key blocks one estimation program scans: enough to amortise loading its query rows.
MASS_BLOCKS_PER_PROGRAM = 16
MASS_BLOCK_R = 64  # estimation query rows per program


@triton.jit
def _prefill_sparse_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    count_ptr,
    index_ptr,
    out_ptr,
    q_len,
    view_len,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ch,
    stride_ih,
    stride_im,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (query head, query block) of one chunk."""
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest lists first, as prefill.py
    kvh = h // GROUP
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    dm = (offs_d < HEAD_DIM)[None, :]
    q_pos = view_len - q_len + offs_m  # [BLOCK_M] view index of each query
    q_rows = offs_m.to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & dm,
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    first_q = view_len - q_len + mb * BLOCK_M
    last_q = view_len - q_len + tl.minimum((mb + 1) * BLOCK_M, q_len) - 1
    full_end = (first_q + 1) // BLOCK_N * BLOCK_N  # keys [0, full_end) visible to all rows
    hi = last_q + 1
    count = tl.load(count_ptr + kvh * stride_ch + mb)
    # The list ends with the diagonal tiles [full_end, hi) (sparse_prefill's invariant).
    n_full = count - (tl.cdiv(hi, BLOCK_N) - full_end // BLOCK_N)
    idx_row = index_ptr + kvh * stride_ih + mb * stride_im
    k_base = k_cache_ptr + kvh * stride_kch
    v_base = v_cache_ptr + kvh * stride_vch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for i in range(0, n_full):
        offs = tl.load(idx_row + i) * BLOCK_N + offs_n  # [BLOCK_N] key view positions
        slot = tl.load(table_row_ptr + offs).to(tl.int64)
        k_ptrs = k_base + slot[:, None] * stride_kcs + offs_d[None, :]
        v_ptrs = v_base + slot[:, None] * stride_vcs + offs_d[None, :]
        m_i, l_i, acc = prefill_tile_step(
            q, k_ptrs, v_ptrs, dm, None, None, None, None, None, None,
            m_i, l_i, acc, qk_scale, None, DOT_PREC, False, False,
        )  # fmt: skip
    for i in range(n_full, count):
        offs = tl.load(idx_row + i) * BLOCK_N + offs_n
        k_valid = offs < hi
        slot = tl.load(table_row_ptr + offs, mask=k_valid, other=0).to(tl.int64)
        k_ptrs = k_base + slot[:, None] * stride_kcs + offs_d[None, :]
        v_ptrs = v_base + slot[:, None] * stride_vcs + offs_d[None, :]
        # Padded query rows (offs_m >= q_len) see every loaded key and are never stored.
        visible = (offs[None, :] <= q_pos[:, None]) & k_valid[None, :]
        m_i, l_i, acc = prefill_tile_step(
            q, k_ptrs, v_ptrs, k_valid[:, None] & dm, None, None, None, None, None, None,
            m_i, l_i, acc, qk_scale, visible, DOT_PREC, True, False,
        )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dm)


def sparse_config(dtype: torch.dtype, block_d: int) -> dict[str, int]:
    """Launch options: the dense kernel's 8 warps / 3 stages for 16-bit caches; 4-byte
    caches (tests, debugging) need twice the shared memory per tile and take 1 stage.
    Heads wider than 128 (Gemma 3: 256) take 2 stages: a 128 x 256 query tile and three
    64 x 256 K/V stages would need 256 KB of shared memory, over the H200's 227 KB."""
    if torch.empty((), dtype=dtype).element_size() > 2:
        return dict(num_warps=4, num_stages=1)
    if block_d > 128:
        return dict(num_warps=8, num_stages=2)
    return dict(num_warps=8, num_stages=3)


def prefill_sparse_attention(
    q: torch.Tensor,  # [n, Hq, D] one chunk's queries
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    table_row: torch.Tensor,  # [>= view_len] int32 slot ids of the view
    view_len: int,
    scale: float,
    block_count: torch.Tensor,  # [Hkv, nqb] int32
    block_index: torch.Tensor,  # [Hkv, nqb, B] int32
    out: torch.Tensor,  # [n, Hq, D]
    *,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """Causal attention of the chunk (the view's last n entries) over the listed key
    blocks of its view; writes and returns `out`. The blocks must be the selection's
    tiles (`block_m` query rows, `block_n` keys)."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    q = check_attention_args(q, k_cache, v_cache, table_row[None], out)
    num_qb = triton.cdiv(n, block_m)
    if block_count.shape != (num_kv_heads, num_qb) or block_index.shape[:2] != (
        num_kv_heads,
        num_qb,
    ):
        raise ValueError(
            f"block_count {tuple(block_count.shape)} / block_index {tuple(block_index.shape)} "
            f"do not match {num_kv_heads} KV heads x {num_qb} query blocks"
        )
    # A size-1 last dimension is never stepped along, whatever its stride (one KV head
    # and one query block give a [1, 1] count that is a view of the selection's sums).
    if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in (block_count, block_index)):
        raise ValueError("block_count and block_index need a unit-stride last dimension")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        # tl.dot needs every operand dimension >= 16 (P @ V contracts over block_n).
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if n == 0:
        return out
    block_d = next_pow2(max(head_dim, 16))
    _prefill_sparse_kernel[(num_q_heads, num_qb)](
        q, k_cache, v_cache, table_row, block_count, block_index, out,
        n, view_len, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), block_count.stride(0),
        block_index.stride(0), block_index.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PREC=dot_precision(k_cache.dtype),
        **sparse_config(k_cache.dtype, block_d),
    )  # fmt: skip
    return out


@triton.jit
def _block_mass_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_cache_ptr,
    table_row_ptr,
    max_ptr,
    sum_ptr,
    num_rows,
    view_len,
    num_kb,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_mh,
    stride_mr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (query head, row tile, key-block range): per row and key block, the max
    logit (base 2) and the sum of 2^(logit - max) over the block's visible keys."""
    h = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] estimation rows
    r_mask = offs_r < num_rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dm = (offs_d < HEAD_DIM)[None, :]
    q_pos = view_len - num_rows + offs_r  # [BLOCK_R] the rows' view positions
    q = tl.load(
        q_ptr + offs_r.to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=r_mask[:, None] & dm,
        other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_D]
    k_base = k_cache_ptr + (h // GROUP) * stride_kch
    b0 = tl.program_id(2) * BLOCKS_PER_PROGRAM
    for b in range(b0, tl.minimum(b0 + BLOCKS_PER_PROGRAM, num_kb)):
        offs = b * BLOCK_N + offs_n  # [BLOCK_N] key view positions
        k_valid = offs < view_len
        slot = tl.load(table_row_ptr + offs, mask=k_valid, other=0).to(tl.int64)
        k = tl.load(
            k_base + slot[:, None] * stride_kcs + offs_d[None, :],
            mask=k_valid[:, None] & dm,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_R, BLOCK_N]
        visible = (offs[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m = tl.max(s, 1)  # [BLOCK_R]; -inf where the row sees none of the block
        e = tl.sum(tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 1)
        ptr_off = h * stride_mh + offs_r * stride_mr + b
        tl.store(max_ptr + ptr_off, m, mask=r_mask)
        tl.store(sum_ptr + ptr_off, e, mask=r_mask)


def block_mass(
    q_rows: torch.Tensor,  # [R, Hq, D] the chunk's last R queries
    k_cache: torch.Tensor,  # [num_slots, Hkv, D] model dtype
    table_row: torch.Tensor,  # [>= view_len] int32 slot ids of the view
    view_len: int,
    scale: float,
    block_n: int = BLOCK_N,
) -> torch.Tensor:  # [Hkv, R, nkb] float32
    """sparse_prefill.block_mass_reference through the slot table, without logits."""
    r, num_q_heads, head_dim = q_rows.shape
    num_kv_heads = k_cache.shape[1]
    num_kb = triton.cdiv(view_len, block_n)
    q_rows = q_rows if q_rows.stride(-1) == 1 else q_rows.contiguous()
    peak = torch.empty((num_q_heads, r, num_kb), dtype=torch.float32, device=q_rows.device)
    sums = torch.empty_like(peak)
    block_r = min(MASS_BLOCK_R, max(16, next_pow2(r)))
    grid = (num_q_heads, triton.cdiv(r, block_r), triton.cdiv(num_kb, MASS_BLOCKS_PER_PROGRAM))
    _block_mass_kernel[grid](
        q_rows, k_cache, table_row, peak, sums,
        r, view_len, num_kb, float(scale) * LOG2E,
        q_rows.stride(0), q_rows.stride(1), k_cache.stride(0), k_cache.stride(1),
        peak.stride(0), peak.stride(1),
        HEAD_DIM=head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(max(head_dim, 16)),
        BLOCKS_PER_PROGRAM=MASS_BLOCKS_PER_PROGRAM,
        DOT_PREC=dot_precision(k_cache.dtype),
        num_warps=4,
    )  # fmt: skip
    # Softmax over the view from the per-block pairs: every row sees key 0, so the row
    # max is finite, and blocks a row cannot see (max -inf) weigh 0.
    row_max = peak.amax(dim=-1, keepdim=True)  # [Hq, R, 1]
    weight = sums * torch.exp2(peak - row_max)  # [Hq, R, nkb]
    mass = weight / weight.sum(dim=-1, keepdim=True)
    return mass.view(num_kv_heads, num_q_heads // num_kv_heads, r, num_kb).sum(dim=1)
