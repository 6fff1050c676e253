"""DeltaKV's reconstruct-in-decode as one Triton kernel (INT4 latents, linear up maps).

For each compressed token i and KV head h (one program each) the kernel computes, in
float32 registers, what `TokenCodec.decode` (sparse/deltakv.py) computes with torch:

    latent = codes * scale + zero                       INT4, planar: channel c in byte
                                                        c % P at bit 4 * (c // P)
    x^     = W_up @ latent + b_up + mean_j refs_j       refs_j: the references' pre-RoPE
                                                        K (un-rotated at their positions)
                                                        and V, read from the full rows
    k      = rotate(x^ key part of head h, pos_i)       rotate-half RoPE

so the up-projection, the references' mean and both rotations never leave registers. A
head's key channels are handled as two halves (d and d + D/2) because RoPE pairs them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2


@triton.jit
def _up_rows(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    w_ptr, b_ptr, c, dm, p, pm, lat_lo, lat_hi, R_DIM: tl.constexpr, P: tl.constexpr
):
    """Rows `c` `[BLOCK_H]` of W_up @ latent + b_up (the latent's two nibble planes)."""
    mask = dm[:, None] & pm[None, :]
    w_lo = tl.load(w_ptr + c[:, None] * R_DIM + p[None, :], mask=mask, other=0.0)
    w_hi = tl.load(w_ptr + c[:, None] * R_DIM + P + p[None, :], mask=mask, other=0.0)
    y = tl.sum(w_lo * lat_lo[None, :], axis=1) + tl.sum(w_hi * lat_hi[None, :], axis=1)
    return y + tl.load(b_ptr + c, mask=dm, other=0.0)


@triton.jit
def _reconstruct_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    codes_ptr,  # [n, >= P] uint8
    par_ptr,  # [n, 2] float32 scale, zero
    w_ptr,  # [C, R_DIM] float32
    b_ptr,  # [C] float32
    fk_ptr,  # [rows, HKV, D] full-row keys (post-RoPE)
    fv_ptr,  # [rows, HKV, D]
    refs_ptr,  # [n, NREF] int64 full rows
    row_pos_ptr,  # [rows] int32
    pos_ptr,  # [n] int64
    freqs_ptr,  # [HALF] float32
    k_out,  # [n, HKV, D] float32
    v_out,  # [n, HKV, D] float32
    stride_codes,
    NREF: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    P: tl.constexpr,
    R_DIM: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, BLOCK_P)
    pm = p < P
    byte = tl.load(codes_ptr + i * stride_codes + p, mask=pm, other=0).to(tl.int32)
    scale = tl.load(par_ptr + 2 * i)
    zero = tl.load(par_ptr + 2 * i + 1)
    lat_lo = tl.where(pm, (byte & 15).to(tl.float32) * scale + zero, 0.0)
    lat_hi = tl.where(pm, (byte >> 4).to(tl.float32) * scale + zero, 0.0)
    d = tl.arange(0, BLOCK_H)
    dm = d < HALF
    ck = h * D + d
    cv = HKV * D + h * D + d
    y_klo = _up_rows(w_ptr, b_ptr, ck, dm, p, pm, lat_lo, lat_hi, R_DIM, P)
    y_khi = _up_rows(w_ptr, b_ptr, ck + HALF, dm, p, pm, lat_lo, lat_hi, R_DIM, P)
    y_vlo = _up_rows(w_ptr, b_ptr, cv, dm, p, pm, lat_lo, lat_hi, R_DIM, P)
    y_vhi = _up_rows(w_ptr, b_ptr, cv + HALF, dm, p, pm, lat_lo, lat_hi, R_DIM, P)
    freqs = tl.load(freqs_ptr + d, mask=dm, other=0.0)
    acc_klo = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_khi = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_vlo = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc_vhi = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(NREF):
        row = tl.load(refs_ptr + i * NREF + j)
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
    codes: torch.Tensor,  # [n, >= r / 2 + 4] uint8: INT4 codes, then float16 scale, zero
    up_weight: torch.Tensor,  # [C, r]
    up_bias: torch.Tensor,  # [C]
    full_k: torch.Tensor,  # [rows, Hkv, D]
    full_v: torch.Tensor,  # [rows, Hkv, D]
    refs: torch.Tensor,  # [n, R] full rows
    row_pos: torch.Tensor,  # [rows] int32
    pos: torch.Tensor,  # [n]
    freqs: torch.Tensor | None,  # [D / 2] (None: no RoPE)
) -> tuple[torch.Tensor, torch.Tensor]:  # K (post-RoPE at pos), V: [n, Hkv, D] float32
    """Compressed tokens' K and V from their INT4 codes and references (module docstring)."""
    n, r = refs.shape[0], up_weight.shape[1]
    hkv, d = full_k.shape[1:]
    half = r // 2
    par = codes[:, half : half + 4].contiguous().view(torch.float16).float()  # [n, 2]
    if freqs is None:
        freqs = torch.zeros(d // 2, device=codes.device)  # angle 0: no rotation
    k = torch.empty((n, hkv, d), dtype=torch.float32, device=codes.device)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    _reconstruct_kernel[(n, hkv)](
        codes,
        par,
        up_weight.float().contiguous(),
        up_bias.float().contiguous(),
        full_k.contiguous(),
        full_v.contiguous(),
        refs.long().contiguous(),
        row_pos.contiguous(),
        pos.long().contiguous(),
        freqs.float().contiguous(),
        k,
        v,
        codes.stride(0),
        NREF=refs.shape[1],
        HKV=hkv,
        D=d,
        HALF=d // 2,
        P=half,
        R_DIM=r,
        BLOCK_P=next_pow2(half),
        BLOCK_H=next_pow2(d // 2),
    )
    return k, v
