"""Compressed DeltaKV tokens rebuilt tile by tile in registers (Triton device functions).

A compressed token (kv/deltakv.py) is

    x = W_up z + b_up + mean_j refs_j      z: its latent (INT4 codes dequantized with
                                           the token's scale and zero, or float16);
                                           refs_j: its references' full rows, keys
                                           turned back to pre-RoPE at the rows' positions
    K = rotate(x_k, pos),  V = x_v

These functions build a tile of such tokens for one KV head: the decode kernel
(decode_deltakv.py) scores the keys where it builds them, the rebuild kernel
(deltakv_rebuild.py) writes keys and values to a dense scratch. Keys are handled as two
halves (channels d and d + D/2) because rotate-half RoPE pairs them. RoPE angles come
from a cos/sin table `[P, D/2]` float32 (deltakv/rope.py), the values the torch
reference rotates with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import next_pow2
from sparsevllm.deltakv.rope import RopeTable, rope_table

COMPRESSED = tl.constexpr(-2)  # kv/deltakv.py's state of a compressed slot


@dataclass(frozen=True)
class DeltaKVTensors:
    """What the DeltaKV decode kernels read of a layer: its storage's tensors
    (kv/deltakv.py) and its linear up map."""

    state: torch.Tensor  # [num_slots] int32: >= 0 a full row, -2 compressed
    latent: torch.Tensor  # [num_slots, latent_bytes] uint8 codes (a prefix per layer)
    refs: torch.Tensor  # [num_slots, R] int32 reference rows
    pos: torch.Tensor  # [num_slots] int32 compressed tokens' positions
    full_k: torch.Tensor  # [rows, Hkv, D] post-RoPE keys, the model dtype
    full_v: torch.Tensor  # [rows, Hkv, D]
    row_pos: torch.Tensor  # [rows] int32
    weight: torch.Tensor  # [2 * Hkv * D, r] W_up, K rows then V rows, row-major
    bias: torch.Tensor | None  # [2 * Hkv * D]
    freqs: torch.Tensor | None  # [D / 2] float32 RoPE frequencies (None: no RoPE)
    bits: int  # 4: r / 2 INT4 code bytes, then a float16 scale and zero; 16: float16

    def check(self, head_dim: int) -> None:
        """Refuse, by name, shapes the tile functions cannot read."""
        check_kernel_shapes(head_dim, self.weight.shape[1], self.bits)
        check_up_weight(self.weight, self.full_k.shape[1], head_dim)

    @property
    def plane(self) -> int:
        """Latent channels per plane (INT4: two planes, the codes' low and high nibbles)."""
        width = self.weight.shape[1]
        return width // 2 if self.bits == 4 else width


@triton.jit
def fp16_at(byte_ptr, mask):  # type: ignore[no-untyped-def]
    """The float16 stored little-endian at `byte_ptr` (any alignment), as float32."""
    b0 = tl.load(byte_ptr, mask=mask, other=0).to(tl.uint16)
    b1 = tl.load(byte_ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def cos_sin(cos_ptr, sin_ptr, at_pos, comp, num_positions, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """cos, sin `[BLOCK_N, HALF]` float32 of positions `at_pos` `[BLOCK_N]` from the table
    (1 and 0 off `comp`). A view index is its position, so the table (as wide as the
    slot table) covers every position; the clamp only keeps a bad one inside it."""
    idx = tl.minimum(tl.maximum(at_pos, 0), num_positions - 1).to(tl.int64)
    at = idx[:, None] * HALF + tl.arange(0, HALF)[None, :]
    m = comp[:, None]
    return tl.load(cos_ptr + at, mask=m, other=1.0), tl.load(sin_ptr + at, mask=m, other=0.0)


@triton.jit
def mac(z, w_at, wm, acc, DOT_PREC: tl.constexpr):  # type: ignore[no-untyped-def]
    """`acc + z @ W^T`, the chunk of W^T loaded at `w_at` (rows off `wm` read as 0)."""
    return tl.dot(z, tl.load(w_at, mask=wm, other=0.0), acc, input_precision=DOT_PREC)


@triton.jit
def up_project(  # type: ignore[no-untyped-def]
    acc_lo, acc_hi, lat_row, comp, wk, z_scale, z_zero, stride_w,
    PW: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """`acc + W_k z` for the tile's latents at `lat_row` `[BLOCK_N, 1]` bytes: channels d
    and d + HALF `[BLOCK_N, HALF]` float32 (`wk`: latent channel 0 of the head's first
    key row). Chunks of BLOCK_R latent channels, so the W loads pipeline."""
    wd = wk.dtype.element_ty
    offs_r = tl.arange(0, BLOCK_R)
    # W_k^T chunks [BLOCK_R, HALF]: latent channel down, output channel across.
    w_lo = wk + tl.arange(0, HALF)[None, :] * stride_w + offs_r[:, None]
    w_hi = w_lo + HALF * stride_w
    for c0 in range(0, PW, BLOCK_R):
        cm = (c0 + offs_r) < PW
        wm = cm[:, None]
        zm = comp & cm[None, :]
        if BITS == 4:
            # Planar INT4 (kv/kivi_codes.py): byte c holds channel c (low nibble) and
            # channel c + PW (high nibble).
            packed = tl.load(lat_row + c0 + offs_r[None, :], mask=zm, other=0)
            z0 = ((packed & 15).to(tl.float32) * z_scale + z_zero).to(wd)  # [BLOCK_N, BLOCK_R]
            z1 = ((packed >> 4).to(tl.float32) * z_scale + z_zero).to(wd)
            acc_lo = mac(z0, w_lo + c0, wm, acc_lo, DOT_PREC)
            acc_lo = mac(z1, w_lo + c0 + PW, wm, acc_lo, DOT_PREC)
            acc_hi = mac(z0, w_hi + c0, wm, acc_hi, DOT_PREC)
            acc_hi = mac(z1, w_hi + c0 + PW, wm, acc_hi, DOT_PREC)
        else:
            z = fp16_at(lat_row + 2 * (c0 + offs_r[None, :]), zm).to(wd)  # [BLOCK_N, BLOCK_R]
            acc_lo = mac(z, w_lo + c0, wm, acc_lo, DOT_PREC)
            acc_hi = mac(z, w_hi + c0, wm, acc_hi, DOT_PREC)
    return acc_lo, acc_hi


@triton.jit
def compressed_keys(  # type: ignore[no-untyped-def]
    lat_row, comp, slot, z_scale, z_zero, wk, bk_ptr, refs_ptr, fk_head, row_pos_ptr,
    pos_ptr, cos_ptr, sin_ptr, num_positions, stride_w, stride_rs, stride_fr,
    HALF: tl.constexpr, PW: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
    NREF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """The compressed tokens' post-RoPE keys, halves `[BLOCK_N, HALF]` float32 (zero off
    `comp`): b_k + the references' mean pre-RoPE key + W_k z, rotated at `pos`."""
    offs_h = tl.arange(0, HALF)
    m2 = comp[:, None]
    y_lo = tl.zeros([comp.shape[0], HALF], tl.float32)
    y_hi = tl.zeros([comp.shape[0], HALF], tl.float32)
    if HAS_BIAS:
        y_lo = tl.where(m2, tl.load(bk_ptr + offs_h).to(tl.float32)[None, :], 0.0)
        y_hi = tl.where(m2, tl.load(bk_ptr + HALF + offs_h).to(tl.float32)[None, :], 0.0)
    refs_at = refs_ptr + slot * stride_rs
    for j in tl.static_range(NREF):
        row = tl.load(refs_at + j, mask=comp, other=0).to(tl.int64)  # [BLOCK_N]
        at = fk_head + row[:, None] * stride_fr + offs_h[None, :]
        lo = tl.load(at, mask=m2, other=0.0).to(tl.float32)
        hi = tl.load(at + HALF, mask=m2, other=0.0).to(tl.float32)
        if HAS_ROPE:
            rp = tl.load(row_pos_ptr + row, mask=comp, other=0)
            cos, sin = cos_sin(cos_ptr, sin_ptr, rp, comp, num_positions, HALF)
            lo, hi = lo * cos + hi * sin, hi * cos - lo * sin  # back by the row's own angle
        y_lo += lo / NREF
        y_hi += hi / NREF
    y_lo, y_hi = up_project(
        y_lo, y_hi, lat_row, m2, wk, z_scale, z_zero, stride_w, PW, BITS, BLOCK_R, HALF,
        DOT_PREC,
    )  # fmt: skip
    if HAS_ROPE:
        at_pos = tl.load(pos_ptr + slot, mask=comp, other=0)
        cos, sin = cos_sin(cos_ptr, sin_ptr, at_pos, comp, num_positions, HALF)
        y_lo, y_hi = y_lo * cos - y_hi * sin, y_hi * cos + y_lo * sin
    return y_lo, y_hi


@triton.jit
def compressed_values(  # type: ignore[no-untyped-def]
    refs_ptr, slot, comp, fv_head, bv_ptr, stride_rs, stride_fr,
    HALF: tl.constexpr, NREF: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """The head-space part of the compressed tokens' values: the references' mean V plus
    b_v, halves `[BLOCK_N, HALF]` float32 (zero off `comp`). W_v z is absorbed."""
    offs_h = tl.arange(0, HALF)
    m2 = comp[:, None]
    v_lo = tl.zeros([comp.shape[0], HALF], tl.float32)
    v_hi = tl.zeros([comp.shape[0], HALF], tl.float32)
    refs_at = refs_ptr + slot * stride_rs
    for j in tl.static_range(NREF):
        row = tl.load(refs_at + j, mask=comp, other=0).to(tl.int64)
        at = fv_head + row[:, None] * stride_fr + offs_h[None, :]
        v_lo += tl.load(at, mask=m2, other=0.0).to(tl.float32)
        v_hi += tl.load(at + HALF, mask=m2, other=0.0).to(tl.float32)
    v_lo = v_lo / NREF
    v_hi = v_hi / NREF
    if HAS_BIAS:
        v_lo += tl.where(m2, tl.load(bv_ptr + offs_h).to(tl.float32)[None, :], 0.0)
        v_hi += tl.where(m2, tl.load(bv_ptr + HALF + offs_h).to(tl.float32)[None, :], 0.0)
    return v_lo, v_hi


@triton.jit
def latent_params(lat_row, comp, PW: tl.constexpr, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The tile's INT4 scale and zero `[BLOCK_N, 1]` float32 (0 off `comp`, so those
    tokens' latents are 0); 1 and 0 for float16 latents."""
    if BITS == 4:
        return fp16_at(lat_row + PW, comp), fp16_at(lat_row + PW + 2, comp)
    else:
        return tl.full(comp.shape, 1.0, tl.float32), tl.zeros(comp.shape, tl.float32)


def rope_args(
    freqs: torch.Tensor | None,
    rope: RopeTable | None,
    width: int,
    head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables the tile functions read `[P, D/2]` float32 (`rope`, else built
    for the slot table's `width` positions); one-row dummies without RoPE (never read)."""
    if freqs is None:
        dummy = torch.zeros((1, head_dim // 2), dtype=torch.float32, device=device)
        return dummy, dummy
    cos, sin = rope if rope is not None else rope_table(freqs.to(device), width)
    want = (head_dim // 2,)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or tuple(t.shape[1:]) != want or not t.is_contiguous():
            raise ValueError(
                f"rope {name} must be a contiguous float32 [P, {head_dim // 2}] table, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    if cos.shape != sin.shape or cos.shape[0] < 1:
        raise ValueError(f"rope cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    return cos, sin


def check_kernel_shapes(head_dim: int, width: int, bits: int) -> None:
    """The shapes the tile functions read: a head of two power-of-two halves of at least 16
    channels (tensor-core operands) and an even latent (INT4 codes pair channels)."""
    if not head_dim_readable(head_dim):
        raise ValueError(
            f"the DeltaKV kernels need head_dim = 2 x a power of two >= 16, got {head_dim}"
        )
    if bits not in (4, 16) or width % 2:
        raise ValueError(
            f"the DeltaKV kernels read 4- or 16-bit latents of even width, got {bits} bits x {width}"
        )


def head_dim_readable(head_dim: int) -> bool:
    """Whether the tile functions read heads of `head_dim` (two power-of-two halves >= 16)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half == next_pow2(half) and half >= 16


def check_up_weight(weight: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """W_up as the tile functions read it: `[2 * Hkv * D, r]` row-major."""
    if weight.shape[0] != 2 * num_kv_heads * head_dim or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [2 * {num_kv_heads} * {head_dim}, r] row-major, got "
            f"{tuple(weight.shape)} with strides {weight.stride()}"
        )
