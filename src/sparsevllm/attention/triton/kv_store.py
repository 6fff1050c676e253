"""Scatter the new tokens' K/V into their KV-pool slots (quantizing them for an int8 or
float8_e4m3fn cache, exactly as `sparsevllm.kv.scaled.quantize`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    check_kv_scales,
    check_last_dim_contiguous,
    next_pow2,
    scale_launch_args,
)
from sparsevllm.kv.scaled import QMAX

# 1.5 * 2**23: adding and subtracting it rounds a float32 |y| < 2**22 to an integer, half
# to even (the sum's ulp is 1 and rounds to nearest even). Plain IEEE adds, so the
# interpreter and the GPU agree, where libdevice.rint has no interpreter version.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _store_quantized(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    x,
    dst,
    scale_dst,
    mask,
    head_mask,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """Quantize rows `x` [BLOCK_H, BLOCK_D] per head as kv.scaled.quantize does: float32,
    scale = absmax / QMAX (1 for an all-zero row), element = x / scale rounded."""
    xf = x.to(tl.float32)
    absmax = tl.max(tl.where(mask, tl.abs(xf), 0.0), 1)  # [BLOCK_H]
    # div_rn: IEEE division like torch's (Triton's `/` is an approximate division).
    scale = tl.math.div_rn(absmax, QMAX)
    scale = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(xf, scale[:, None])  # [BLOCK_H, BLOCK_D]
    if IS_INT:
        y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    tl.store(scale_dst, scale, mask=head_mask)


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
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
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """One program: token `t`, heads [hb * BLOCK_H, (hb + 1) * BLOCK_H)."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    # int64: num_slots * Hkv * D can exceed 2**31 elements in a large pool.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    # Slot -1 marks a padding row of a CUDA-graph batch: the mask skips it entirely.
    head_mask = (offs_h < num_heads) & (slot >= 0)  # [BLOCK_H]
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    if QUANT:
        ks_dst = k_scale_ptr + slot * stride_kss + offs_h * stride_ksh  # [BLOCK_H]
        vs_dst = v_scale_ptr + slot * stride_vss + offs_h * stride_vsh
        _store_quantized(k, k_dst, ks_dst, mask, head_mask, QMAX, IS_INT)
        _store_quantized(v, v_dst, vs_dst, mask, head_mask, QMAX, IS_INT)
    else:
        # The cast lets fp32/bf16 activations feed any float cache dtype.
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
    v_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
) -> None:
    """Write `k[t]`, `v[t]` into slot `slot_mapping[t]` of the caches (in place).

    For an int8 or float8_e4m3fn cache, `k_scale`/`v_scale` receive each written token's
    per-head scales and the caches its elements, bit-identical to kv.scaled.quantize.
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
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
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
        *scale_launch_args(k_scale, v_scale, slot_mapping),
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
        QUANT=quantized,
        QMAX=QMAX.get(k_cache.dtype, 0.0),
        IS_INT=k_cache.dtype == torch.int8,
        num_warps=4,
    )


@triton.jit
def _store_rows_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    x_ptr,
    cache_ptr,
    slot_ptr,
    scale_ptr,
    stride_ss,
    stride_sh,
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    IS_INT: tl.constexpr,
):
    """One program: token `t`, heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of one buffer."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    head_mask = (offs_h < num_heads) & (slot >= 0)  # slot -1: a padding row, skipped
    mask = head_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask)
    dst = cache_ptr + slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    if QUANT:
        scale_dst = scale_ptr + slot * stride_ss + offs_h * stride_sh  # [BLOCK_H]
        _store_quantized(x, dst, scale_dst, mask, head_mask, QMAX, IS_INT)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


def store_rows(
    x: torch.Tensor,  # [T, H, D]
    cache: torch.Tensor,  # [num_slots, H, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = skip
    scale: torch.Tensor | None = None,  # [num_slots, H] float32
) -> None:
    """Write `x[t]` into slot `slot_mapping[t]` of one buffer (in place): a shared-KV
    layout's rows (MLA's latent `[c_kv | k_pe]`, kv/latent.py), whose value is a view of
    the same buffer and needs no write of its own. Quantizes for an int8 or float8_e4m3fn
    cache exactly as `store_kv` (bit-identical to kv.scaled.quantize over each whole
    row). No host sync: safe inside CUDA-graph capture."""
    num_tokens, num_heads, head_dim = x.shape
    if cache.shape[1:] != (num_heads, head_dim) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, cache {tuple(cache.shape)}, "
            f"slot_mapping {tuple(slot_mapping.shape)}"
        )
    quantized = check_kv_scales(cache, cache, scale, scale)
    if num_tokens == 0:
        return
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("cache", cache)
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_heads), max(1, 2048 // block_d))
    scale_ptr, _, stride_ss, stride_sh, _, _ = scale_launch_args(scale, scale, slot_mapping)
    _store_rows_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x,
        cache,
        slot_mapping,
        scale_ptr,
        stride_ss,
        stride_sh,
        x.stride(0),
        x.stride(1),
        cache.stride(0),
        cache.stride(1),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANT=quantized,
        QMAX=QMAX.get(cache.dtype, 0.0),
        IS_INT=cache.dtype == torch.int8,
        num_warps=4,
    )
