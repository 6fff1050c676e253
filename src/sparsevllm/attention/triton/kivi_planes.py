"""KIVI's packed code planes in registers, and the pieces the two KIVI decode kernels
(decode_kivi.py: one-group tiles; decode_kivi_rest.py: the rest of a view) share.

A packed row of D channels holds 8 / bits planes of P = D * bits / 8 channels, plane b in
bits b * bits of the row's P bytes (kv/kivi_codes.py). These helpers turn a tile's
packed rows `[BLOCK_N, P]` into one plane's values: as `bias + code` for a dot whose
other operand carries the scale (a tile of one key group, per-token values), or
dequantized entry by entry with each entry's own parameters (the general case).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def code_bias(DT: tl.constexpr):  # type: ignore[no-untyped-def]
    # The smallest power of two whose mantissa unit is 1: bf16 (7 bits) 128, fp16 1024.
    if DT == tl.bfloat16:
        return 128.0
    elif DT == tl.float16:
        return 1024.0
    else:
        return 0.0


def _unpack_bf16_asm(shift: int, mask: int) -> tl.constexpr:
    """PTX turning 4 packed bytes into 4 bf16 `128 + ((byte >> shift) & mask)`: one shift
    of the word, two byte permutes spreading bytes (0, 1) and (2, 3) over 16-bit lanes,
    two `(x & mask) | 128` (LOP3): about one instruction per code where Triton's
    elementwise ops spend four (widen, shift, and, or)."""
    src = "$2" if shift == 0 else "w"
    lanes = f"0x{mask:04X}{mask:04X}"
    return tl.constexpr(
        "{ .reg .b32 w, lo, hi, z; mov.b32 z, 0; "
        + ("" if shift == 0 else f"shr.b32 w, $2, {shift}; ")
        + f"prmt.b32 lo, {src}, z, 0x4140; prmt.b32 hi, {src}, z, 0x4342; "
        + f"lop3.b32 $0, lo, {lanes}, 0x43004300, 0xEA; "
        + f"lop3.b32 $1, hi, {lanes}, 0x43004300, 0xEA; }}"
    )


# Plane b of int4 (int2) codes: bits 4 * b (2 * b) of each byte.
_ASM_INT4_0, _ASM_INT4_1 = _unpack_bf16_asm(0, 15), _unpack_bf16_asm(4, 15)
_ASM_INT2_0, _ASM_INT2_1 = _unpack_bf16_asm(0, 3), _unpack_bf16_asm(2, 3)
_ASM_INT2_2, _ASM_INT2_3 = _unpack_bf16_asm(4, 3), _unpack_bf16_asm(6, 3)


@triton.jit
def _asm_plane(packed, asm: tl.constexpr):  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise(
        asm, "=r,=r,r", [packed], dtype=tl.bfloat16, is_pure=True, pack=4
    )


@triton.jit
def _bf16_plane_asm(packed, b: tl.constexpr, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    if BITS == 4:
        if b == 0:
            return _asm_plane(packed, _ASM_INT4_0)
        else:
            return _asm_plane(packed, _ASM_INT4_1)
    elif b == 0:
        return _asm_plane(packed, _ASM_INT2_0)
    elif b == 1:
        return _asm_plane(packed, _ASM_INT2_1)
    elif b == 2:
        return _asm_plane(packed, _ASM_INT2_2)
    else:
        return _asm_plane(packed, _ASM_INT2_3)


@triton.jit
def biased_plane(packed, b: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """Plane b of packed rows `[N, P]` as DT values `code_bias(DT) + code`: in bf16 (fp16)
    the exponent of 128 (1024) OR the code in the low mantissa bits (bf16 on a GPU: in
    PTX, `ASM`)."""
    if ASM:
        return _bf16_plane_asm(packed, b, BITS)
    c = (packed.to(tl.int32) >> (b * BITS)) & ((1 << BITS) - 1)
    if DT == tl.bfloat16:
        return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float16:
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return c.to(DT)


@triton.jit
def halves(w):  # type: ignore[no-untyped-def]
    """An int32 holding two float16 (a scale, then a zero point) -> both as float32."""
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def sealed_plane_qk(  # type: ignore[no-untyped-def]
    kb,
    gw,
    q_b,
    b: tl.constexpr,
    P: tl.constexpr,
    BITS: tl.constexpr,
    DT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    ASM: tl.constexpr,
    KDEQ: tl.constexpr,
):
    """Plane b's share of a one-group tile's logits `[BLOCK_G, BLOCK_N]`; `gw` `[P]`
    int32: the group's (scale, zero) pairs of plane b's channels. `KDEQ`: the keys
    dequantized in registers (`(bias + code) * s + (z - bias * s)`, rounded to DT) and
    dotted with the query as loaded, whose operand is the same every tile; else the dot
    of the scaled query channels with `bias + code`, less the bias's excess, plus
    `q . z`."""
    s, z = halves(gw)  # [P] the group's parameters
    if KDEQ:
        zb = z - code_bias(DT) * s
        k = biased_plane(kb, b, BITS, DT, ASM).to(tl.float32) * s[None, :] + zb[None, :]
        return tl.dot(q_b.to(DT), tl.trans(k.to(DT)), input_precision=DOT_PREC)
    q_s = (q_b * s[None, :]).to(DT)  # [BLOCK_G, P]
    qk = tl.dot(q_s, tl.trans(biased_plane(kb, b, BITS, DT, ASM)), input_precision=DOT_PREC)
    corr = tl.sum(q_s.to(tl.float32) * code_bias(DT) - q_b * z[None, :], 1)  # [BLOCK_G]
    return qk - corr[:, None]


@triton.jit
def any_plane(  # type: ignore[no-untyped-def]
    cb,
    st,
    gp,
    rp,
    b: tl.constexpr,
    v_par,
    P: tl.constexpr,
    BITS: tl.constexpr,
    IS_KEY: tl.constexpr,
):
    """Plane b of a tile's keys or values `[BLOCK_N, P]` (float32), each entry
    dequantized with its own parameters (its key group's, or its own value scale and
    zero point `v_par`) or read from its residual row `rp` (-1: an empty entry, 0)."""
    offs = b * P + tl.arange(0, P)
    sealed = st >= 0
    c = ((cb.to(tl.int32) >> (b * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    if IS_KEY:
        w = tl.load(gp[:, None] + offs[None, :], mask=sealed[:, None], other=0)
        s, z = halves(w)  # [BLOCK_N, P]
    else:
        s, z = halves(v_par)  # [BLOCK_N]
        s, z = s[:, None], z[:, None]
    res = tl.load(rp[:, None] + offs[None, :], mask=(st <= -2)[:, None], other=0.0)
    return tl.where(sealed[:, None], c * s + z, res.to(tl.float32))


@triton.jit
def softmax_step(qk, m_i, l_i):  # type: ignore[no-untyped-def]
    """Online softmax over one more tile of base-2 logits `[BLOCK_G, BLOCK_N]`: the
    probabilities, the factor that rescales what was accumulated, the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def query_planes(q_at, g_mask, P: tl.constexpr, NPL: tl.constexpr):  # type: ignore[no-untyped-def]
    """The query heads of one KV head `[BLOCK_G, P]` per plane (float32; `q_at` points at
    channel 0 of each head's row, `[BLOCK_G, P]`); planes an int4 row lacks repeat q0."""
    q0 = tl.load(q_at, mask=g_mask[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(q_at + P, mask=g_mask[:, None], other=0.0).to(tl.float32)
    if NPL == 4:
        q2 = tl.load(q_at + 2 * P, mask=g_mask[:, None], other=0.0).to(tl.float32)
        q3 = tl.load(q_at + 3 * P, mask=g_mask[:, None], other=0.0).to(tl.float32)
    else:
        q2 = q0
        q3 = q0
    return q0, q1, q2, q3


@triton.jit
def store_partial(  # type: ignore[no-untyped-def]
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, base, g_mask, m_i, l_i, zacc, acc0, acc1, acc2, acc3,
    HEAD_DIM: tl.constexpr, P: tl.constexpr, NPL: tl.constexpr,
):  # fmt: skip
    """One split's softmax state for merge_splits (decode.py): at `base` `[BLOCK_G]` (the
    query heads' entries), the max, the sum and the unnormalised output (plus `zacc`,
    the values' zero points weighted by the probabilities, on every channel)."""
    tl.store(ws_m_ptr + base, m_i, mask=g_mask)
    tl.store(ws_l_ptr + base, l_i, mask=g_mask)
    w_at = ws_acc_ptr + base[:, None] * HEAD_DIM + tl.arange(0, P)[None, :]
    tl.store(w_at, acc0 + zacc[:, None], mask=g_mask[:, None])
    tl.store(w_at + P, acc1 + zacc[:, None], mask=g_mask[:, None])
    if NPL == 4:
        tl.store(w_at + 2 * P, acc2 + zacc[:, None], mask=g_mask[:, None])
        tl.store(w_at + 3 * P, acc3 + zacc[:, None], mask=g_mask[:, None])
