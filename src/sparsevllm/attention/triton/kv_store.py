"""Scatter the new tokens' K/V into their KV-pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import check_last_dim_contiguous, next_pow2


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: token `t`, heads [hb * BLOCK_H, (hb + 1) * BLOCK_H)."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    # int64: num_slots * Hkv * D can exceed 2**31 elements in a large pool.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    # Slot -1 marks a padding row of a CUDA-graph batch: the mask skips it entirely.
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :] & (slot >= 0)

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    # The cast lets fp32/bf16 activations feed any float cache dtype.
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
) -> None:
    """Write `k[t]`, `v[t]` into slot `slot_mapping[t]` of the caches (in place).

    `k`/`v` may be strided views (e.g. slices of a fused QKV output) as long as the last
    dimension is contiguous. No host sync: safe inside CUDA-graph capture.
    """
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[1:] != (num_heads, head_dim):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"k_cache {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"shape mismatch: v_cache {tuple(v_cache.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}"
        )
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    block_d = next_pow2(head_dim)
    # ~2K elements per tile keeps registers low while a token's heads stay in one program.
    block_h = min(next_pow2(num_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
