"""DeltaKV's reconstruct-in-decode (linear up maps): a GEMM and a Triton epilogue.

What `TokenCodec.decode` (sparse/deltakv_codec.py) computes with torch, for n compressed
tokens at once:

    y      = up(latent)                                 the caller's up map, one GEMM
                                                        over the step's tokens
    x^     = y + mean_j refs_j                          refs_j: the references' pre-RoPE
                                                        K (un-rotated at their positions)
                                                        and V, read from the full rows
    k      = rotate(x^ key part, pos_i)                 rotate-half RoPE

The up map runs once over every token the step reads (the caller's GEMM: float32 for a
float32 pool, the pool's dtype with float32 accumulation for a 16-bit one, whose rows
hold the result in 16 bits anyway), so W_up is read once per layer, not once per token;
the epilogue kernel (one program per token and KV head) reads y, gathers the references' rows, and keeps the references' mean and both rotations in
registers. A head's key channels are handled as two halves (d and d + D/2) because RoPE
pairs them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2


@triton.jit
def _reconstruct_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    y_ptr,  # [n, 2 * HKV * D] float32 or the pool's 16-bit dtype: W_up @ latent + b_up
    fk_ptr,  # [rows, HKV, D] full-row keys (post-RoPE)
    fv_ptr,  # [rows, HKV, D]
    refs_ptr,  # [n, NREF] int64 full rows
    row_pos_ptr,  # [rows] int32
    pos_ptr,  # [n] int64
    freqs_ptr,  # [HALF] float32
    k_out,  # [n, HKV, D] float32
    v_out,  # [n, HKV, D] float32
    NREF: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_H)
    dm = d < HALF
    y_k = y_ptr + i * 2 * HKV * D + h * D + d
    y_v = y_k + HKV * D
    y_klo = tl.load(y_k, mask=dm, other=0.0).to(tl.float32)
    y_khi = tl.load(y_k + HALF, mask=dm, other=0.0).to(tl.float32)
    y_vlo = tl.load(y_v, mask=dm, other=0.0).to(tl.float32)
    y_vhi = tl.load(y_v + HALF, mask=dm, other=0.0).to(tl.float32)
    freqs = tl.load(freqs_ptr + d, mask=dm, other=0.0)
    acc_klo = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_khi = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_vlo = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_vhi = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(NREF):
        row = tl.load(refs_ptr + i * NREF + j)  # int64: rows x HKV x D may pass 2^31
        ang = tl.load(row_pos_ptr + row).to(tl.float32) * freqs
        cos, sin = tl.cos(ang), tl.sin(ang)
        at = fk_ptr + row * HKV * D + h * D + d
        klo = tl.load(at, mask=dm, other=0.0).to(tl.float32)
        khi = tl.load(at + HALF, mask=dm, other=0.0).to(tl.float32)
        acc_klo += klo * cos + khi * sin  # turned back to pre-RoPE
        acc_khi += khi * cos - klo * sin
        at_v = fv_ptr + row * HKV * D + h * D + d
        acc_vlo += tl.load(at_v, mask=dm, other=0.0).to(tl.float32)
        acc_vhi += tl.load(at_v + HALF, mask=dm, other=0.0).to(tl.float32)
    pre_lo = y_klo + acc_klo / NREF
    pre_hi = y_khi + acc_khi / NREF
    ang = tl.load(pos_ptr + i).to(tl.float32) * freqs
    cos, sin = tl.cos(ang), tl.sin(ang)
    out = i * HKV * D + h * D + d
    tl.store(k_out + out, pre_lo * cos - pre_hi * sin, mask=dm)
    tl.store(k_out + out + HALF, pre_hi * cos + pre_lo * sin, mask=dm)
    tl.store(v_out + out, y_vlo + acc_vlo / NREF, mask=dm)
    tl.store(v_out + out + HALF, y_vhi + acc_vhi / NREF, mask=dm)


def reconstruct(
    y: torch.Tensor,  # [n, 2 * Hkv * D]: the up map of the latents (float32 or 16-bit)
    full_k: torch.Tensor,  # [rows, Hkv, D]
    full_v: torch.Tensor,  # [rows, Hkv, D]
    refs: torch.Tensor,  # [n, R] full rows
    row_pos: torch.Tensor,  # [rows] int32
    pos: torch.Tensor,  # [n]
    freqs: torch.Tensor | None,  # [D / 2] (None: no RoPE)
) -> tuple[torch.Tensor, torch.Tensor]:  # K (post-RoPE at pos), V: [n, Hkv, D] float32
    """Compressed tokens' K and V from their up-projected latents and references (module
    docstring)."""
    n = refs.shape[0]
    hkv, d = full_k.shape[1:]
    k = torch.empty((n, hkv, d), dtype=torch.float32, device=y.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    if freqs is None:
        freqs = torch.zeros(d // 2, device=y.device)  # angle 0: no rotation
    _reconstruct_kernel[(n, hkv)](
        y.contiguous(),
        full_k.contiguous(),
        full_v.contiguous(),
        refs.long().contiguous(),
        row_pos.contiguous(),
        pos.long().contiguous(),
        freqs.float().contiguous(),
        k,
        v,
        NREF=refs.shape[1],
        HKV=hkv,
        D=d,
        HALF=d // 2,
        BLOCK_H=next_pow2(d // 2),
    )
    return k, v
