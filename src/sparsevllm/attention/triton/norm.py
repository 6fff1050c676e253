"""Fused RMSNorm: one kernel per call instead of eight small eager ops.

An eager RMSNorm launches a float cast, pow, mean, add, rsqrt, mul, a cast back and the
weight product; at decode those are launch-bound (a batch-128 decode step of Llama-3-8B
spent ~2 ms of GPU time in them, docs/benchmarks/h200/profile_snapkv_b128.json). Here
each program normalises one row in float32 with the same rounding points as the torch
module it replaces:

* Llama / Qwen (`gemma=False`): `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, the
  product taken in the input dtype (as HF's LlamaRMSNorm);
* Gemma (`gemma=True`): `(x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(dtype)`, all in
  float32 before the one cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    x_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """Program r: row r of x `[rows, n_cols]`."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if GEMMA:
        y = xf * inv * (1.0 + w.to(tl.float32))
    else:
        # Round the normalised row to the input dtype first, then the weight product
        # (computed in float32 and rounded again, as a 16-bit torch multiply does).
        y = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` `[..., n]` with `weight` `[n]`.

    The output has x's dtype and shape, except that a Llama-style norm with a weight of
    another (wider) dtype returns the promoted dtype, as the torch module does.
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight must be [{n}], got {tuple(weight.shape)}")
    x2 = x.reshape(-1, n)  # [rows, n]; a view when the rows are evenly strided
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if gemma else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((x2.shape[0], n), dtype=out_dtype, device=x.device)  # [rows, n]
    if x2.shape[0]:
        block = next_pow2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            out.stride(0),
            n,
            float(eps),
            BLOCK=block,
            GEMMA=gemma,
            num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
        )
    return out.view(x.shape)
