"""KIVI's asymmetric integer codes: quantization parameters, quantize, pack, unpack.

A group of values `x` maps onto the codes `0 .. 2^bits - 1` through a scale and a zero
point (the group's minimum): `code = round((x - zero) / scale)`, `x ~ code * scale +
zero`. Scale and zero are stored in float16 (as KIVI does) and the codes are computed
with the stored (rounded) parameters, so that dequantizing gives back exactly what the
quantizer aimed at. `8 / bits` codes share a byte, in planes: a row of D channels is
`8 / bits` planes of P = D * bits / 8 consecutive channels, and channel `c` lives in byte
`c % P` at bit `bits * (c // P)` (a kernel unpacks plane p of a row with one shift of
the row's contiguous bytes, and multiplies it with the query's channels p*P .. p*P+P-1).

These are the reference of the quantize-on-seal and dequantize-in-register kernels.
"""

from __future__ import annotations

import torch

PARAM_DTYPE = torch.float16  # KIVI stores scales and zero points in half precision


def code_max(bits: int) -> int:
    return (1 << bits) - 1


def params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Scale and zero point of groups spanning `[lo, hi]` (float32, any shape `[...]`):
    `[..., 2]` in PARAM_DTYPE. A constant group gets scale 1 (every code is 0)."""
    span = hi - lo
    # A tensor divisor keeps CUDA's IEEE division (see kv/scaled.py).
    scale = span / torch.full_like(span, code_max(bits))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.stack((scale, lo), dim=-1).to(PARAM_DTYPE)


def quantize(x: torch.Tensor, par: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `x` (float32) under parameters `par` `[..., 2]` whose scale and zero
    broadcast against `x` elementwise: uint8, rounded half to even and clamped."""
    scale, zero = par[..., 0].float(), par[..., 1].float()
    codes = torch.round((x - zero) / scale).clamp(0, code_max(bits))
    return codes.to(torch.uint8)


def dequantize(codes: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
    """Values of uint8 `codes` under `par` `[..., 2]` (broadcast elementwise), float32."""
    return codes.float() * par[..., 0].float() + par[..., 1].float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., D]` -> packed bytes `[..., D * bits / 8]` (planar, above)."""
    per_byte = 8 // bits
    planes = codes.view(*codes.shape[:-1], per_byte, codes.shape[-1] // per_byte).int()
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (planes << shifts.unsqueeze(-1)).sum(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes `[..., P]` -> uint8 codes `[..., P * 8 / bits]`."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.int().unsqueeze(-2) >> shifts.unsqueeze(-1)) & code_max(bits)
    return codes.to(torch.uint8).flatten(-2)


def group_params(x: torch.Tensor, valid: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-channel parameters of token groups: `x` `[n, G, ...]` float32 with `valid`
    `[n, G]` (padding and already-quantized entries left out) -> `[n, ..., 2]`."""
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    inf = torch.full_like(x, float("inf"))
    lo = torch.where(mask, x, inf).amin(1)
    hi = torch.where(mask, x, -inf).amax(1)
    empty = ~valid.any(1).view(-1, *([1] * (lo.dim() - 1)))
    lo = torch.where(empty, torch.zeros_like(lo), lo)
    hi = torch.where(empty, torch.zeros_like(hi), hi)
    return params(lo, hi, bits)


def token_params(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token parameters over the last dimension: `x` `[..., D]` float32 -> `[..., 2]`."""
    return params(x.amin(-1), x.amax(-1), bits)


def quantize_tokens(x: torch.Tensor, par: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `x` `[..., D]` under per-token parameters `par` `[..., 2]`."""
    return quantize(x, par.unsqueeze(-2), bits)


def dequantize_tokens(codes: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
    """Values of `codes` `[..., D]` under per-token `par` `[..., 2]` (float32)."""
    return dequantize(codes, par.unsqueeze(-2))
