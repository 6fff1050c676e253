"""Fused rotary embedding (rotate-half layout, as HF) for q and k in one launch.

The eager version gathers cos/sin, casts, splits, multiplies, concatenates and casts
back, twice per layer: ~20 small kernels per layer at decode. Here one program per token
rotates all its query and key heads, in float32 from the float32 cos/sin caches, and
rounds once to the input dtype, as `layers/rotary.py` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    x_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    t,
    heads,
    c,
    s,
    offs_h,
    offs_d,
    HALF: tl.constexpr,
):
    """Rotate the `heads` heads of token t: x1' = x1 c - x2 s, x2' = x2 c + x1 s."""
    mask = (offs_h < heads)[:, None] & (offs_d < HALF)[None, :]  # [BLOCK_H, BLOCK_HALF]
    base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    obase = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(obase, o1.to(dtype), mask=mask)
    tl.store(obase + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    """Program t: token t's query and key heads."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    c = tl.load(cos_ptr + pos * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        t,
        num_q_heads,
        c,
        s,
        tl.arange(0, BLOCK_HQ),
        offs_d,
        HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        t,
        num_k_heads,
        c,
        s,
        tl.arange(0, BLOCK_HK),
        offs_d,
        HALF,
    )


def apply_rope(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_cache: torch.Tensor,  # [max_position, D / 2] float32
    sin_cache: torch.Tensor,  # [max_position, D / 2] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q and k at `positions`; returns new tensors of their shapes and dtypes."""
    t, _, d = q.shape
    half = d // 2
    if k.shape[0] != t or k.shape[2] != d or d % 2 or cos_cache.shape[1] != half:
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos_cache.shape)}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a unit-stride head dimension")
    if not (cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise ValueError("the cos/sin caches must be contiguous")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if t:
        _rope_kernel[(t,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos_cache,
            sin_cache,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            q.shape[1],
            k.shape[1],
            HALF=half,
            BLOCK_HALF=next_pow2(half),
            BLOCK_HQ=next_pow2(q.shape[1]),
            BLOCK_HK=next_pow2(k.shape[1]),
            num_warps=4,
        )
    return q_out, k_out
