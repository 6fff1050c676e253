"""Quest page scores for a whole decode batch, reading the page pool through a page table.

Program (sequence, KV head, block of pages): load the block's page ids from the row's
page table, each page's (min, max) key bounds for the head, and write
sum_d q_pos_d * max_d + q_neg_d * min_d (the upper bound of q.k over the page, summed
over the head's query heads; see sparse/quest.py). Pages at or past a row's `full`
count score -inf. Reads each row's pages once, with no gathered copy of the bounds.

CUDA-graph capturable: no host sync, grid and buffers sized from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2


@triton.jit
def _quest_scores_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_pos_ptr,
    q_neg_ptr,
    bounds_ptr,
    table_ptr,
    full_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_bp,
    stride_bb,
    stride_bh,
    stride_ts,
    stride_os,
    stride_oh,
    num_pages,
    HEAD_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = offs_d < HEAD_DIM
    full = tl.load(full_ptr + s)
    valid = offs_p < full
    q_off = s.to(tl.int64) * stride_qs + h * stride_qh + offs_d
    q_pos = tl.load(q_pos_ptr + q_off, mask=d_mask, other=0.0)  # [BLOCK_D] fp32
    q_neg = tl.load(q_neg_ptr + q_off, mask=d_mask, other=0.0)
    page = tl.load(table_ptr + s.to(tl.int64) * stride_ts + offs_p, mask=valid, other=0)
    base = bounds_ptr + page.to(tl.int64)[:, None] * stride_bp + h * stride_bh + offs_d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    lo = tl.load(base, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    hi = tl.load(base + stride_bb, mask=mask, other=0.0).to(tl.float32)
    score = tl.sum(hi * q_pos[None, :] + lo * q_neg[None, :], axis=1)  # [BLOCK_P]
    score = tl.where(valid, score, float("-inf"))
    o_ptr = out_ptr + s.to(tl.int64) * stride_os + h * stride_oh + offs_p
    tl.store(o_ptr, score, mask=offs_p < num_pages)


def quest_batch_scores(
    q_pos: torch.Tensor,  # [S, Hkv, D] float32: sum over the head's queries of relu(q)
    q_neg: torch.Tensor,  # [S, Hkv, D] float32: ... of min(q, 0)
    bounds: torch.Tensor,  # [capacity, 2, Hkv, D] (min, max) per page
    table: torch.Tensor,  # [S, P] int32 page ids of each row's pages, in view order
    full: torch.Tensor,  # [S] int32 pages of each row that count
    block_p: int = 32,
) -> torch.Tensor:  # [S, Hkv, P] float32
    num_seqs, num_kv_heads, head_dim = q_pos.shape
    num_pages = table.shape[1]
    if bounds.shape[1:] != (2, num_kv_heads, head_dim) or bounds.stride(-1) != 1:
        raise ValueError(f"bounds must be [capacity, 2, {num_kv_heads}, {head_dim}]")
    q_pos, q_neg = q_pos.contiguous(), q_neg.contiguous()
    table = table.contiguous()
    out = torch.empty((num_seqs, num_kv_heads, num_pages), dtype=torch.float32, device=q_pos.device)
    if num_seqs == 0 or num_pages == 0:
        return out
    grid = (num_seqs, num_kv_heads, triton.cdiv(num_pages, block_p))
    _quest_scores_kernel[grid](
        q_pos,
        q_neg,
        bounds,
        table,
        full.to(torch.int32),
        out,
        q_pos.stride(0),
        q_pos.stride(1),
        bounds.stride(0),
        bounds.stride(1),
        bounds.stride(2),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        num_pages,
        HEAD_DIM=head_dim,
        BLOCK_P=block_p,
        BLOCK_D=next_pow2(max(head_dim, 16)),
        num_warps=4,
    )
    return out
