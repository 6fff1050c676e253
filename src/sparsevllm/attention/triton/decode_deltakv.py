"""Decode attention over DeltaKV storage (kv/deltakv.py), reconstructing in registers.

The torch path reads a DeltaKV view by materialising it: every compressed token's
up-projection (one GEMM over the view), an epilogue that adds its references' mean and
rotates the key, then a gathered `[L, Hkv, D]` copy of the view for attention. Here one
program (KV head, sequence, split) walks its split of the view in tiles of BLOCK_N
tokens. A compressed token is

    x = W_up z + b_up + mean_j refs_j      z: its latent (INT4 codes dequantized with
                                           the token's scale and zero, or float16);
                                           refs_j: its references' full rows, keys
                                           turned back to pre-RoPE at the rows' positions
    K = rotate(x_k, pos),  V = x_v

and a full token is its row (post-RoPE key, as stored).

Keys are built per tile, where they are scored: tensor-core dots of the tile's latents
with this head's key rows of W_up (`[D, r]`, re-read from L2 by every tile, in BLOCK_R
chunks so the loads pipeline), plus the references' mean, rotated at the token's
position. A tile of full tokens only (the recent window, the sink) skips that work. Keys
are handled as two halves (channels d and d + D/2) because rotate-half RoPE pairs them:
the query is split the same way, so a score is q_lo . k_lo + q_hi . k_hi.

Values are never up-projected per token. Attention is linear in V, so

    sum_t p_t V_t = W_v (sum_{t compressed} p_t z_t) + sum_t p_t h_t

with h_t a full token's row, or a compressed token's references' mean V plus b_v. The
program keeps a latent accumulator `acc_z` `[BLOCK_G, r]` (INT4: two planes, the codes'
low-nibble channels [0, r/2) and high-nibble channels [r/2, r)) beside the head-space
one, rescales both in the online softmax, and up-projects once at its end:
`acc_h + acc_z W_v^T`. That halves the W_up traffic and the dots of v1 (which built V
per tile).

RoPE angles come from a cos/sin table `[P, D/2]` float32 (`rope_table`, deltakv/rope.py:
the values `rotate` and `unrotate` use, so the reference's own) instead of five
libdevice sin/cos per element and token. The tile's K, the p @ V operands and the latent
accumulator are rounded to the model dtype before their dots (what the torch path's
16-bit view holds); accumulation is float32.

Splits write their softmax states to a workspace merged by `merge_splits` (decode.py);
their count defaults to `deltakv_num_splits`, a few programs per SM from the shapes alone
(never the lengths: graph-safe), and is the grid's, not a compile-time constant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    LOG2E,
    dot_precision,
    next_pow2,
    num_sms,
    split_workspace,
)
from sparsevllm.attention.triton.decode import merge_splits
from sparsevllm.attention.triton.kivi_planes import softmax_step
from sparsevllm.deltakv.rope import RopeTable, rope_table

COMPRESSED = tl.constexpr(-2)  # kv/deltakv.py's state of a compressed slot

# Programs per SM the default split count aims for. Unlike the memory-bound decode
# kernels (PROGRAMS_PER_SM in _common.py), a program here holds a latent accumulator of
# r floats per query head and runs dots on every tile: a few programs per SM fill it,
# and each split adds a W_v projection (one head's rows of W_up) at its end.
DELTAKV_PROGRAMS_PER_SM = 3
# Fewest view positions per split: a split's fixed cost (W_v projection) stays small
# against its tiles'.
DELTAKV_MIN_SPLIT_TOKENS = 512
DELTAKV_MAX_SPLITS = 64


@triton.jit
def _fp16_at(byte_ptr, mask):  # type: ignore[no-untyped-def]
    """The float16 stored little-endian at `byte_ptr` (any alignment), as float32."""
    b0 = tl.load(byte_ptr, mask=mask, other=0).to(tl.uint16)
    b1 = tl.load(byte_ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, at_pos, comp, num_positions, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """cos, sin `[BLOCK_N, HALF]` float32 of positions `at_pos` `[BLOCK_N]` from the table
    (1 and 0 off `comp`). A view index is its position, so the table (as wide as the
    slot table) covers every position; the clamp only keeps a bad one inside it."""
    idx = tl.minimum(tl.maximum(at_pos, 0), num_positions - 1).to(tl.int64)
    at = idx[:, None] * HALF + tl.arange(0, HALF)[None, :]
    m = comp[:, None]
    return tl.load(cos_ptr + at, mask=m, other=1.0), tl.load(sin_ptr + at, mask=m, other=0.0)


@triton.jit
def _mac(z, w_at, wm, acc, DOT_PREC: tl.constexpr):  # type: ignore[no-untyped-def]
    """`acc + z @ W^T`, the chunk of W^T loaded at `w_at` (rows off `wm` read as 0)."""
    return tl.dot(z, tl.load(w_at, mask=wm, other=0.0), acc, input_precision=DOT_PREC)


@triton.jit
def _key_up(  # type: ignore[no-untyped-def]
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
            acc_lo = _mac(z0, w_lo + c0, wm, acc_lo, DOT_PREC)
            acc_lo = _mac(z1, w_lo + c0 + PW, wm, acc_lo, DOT_PREC)
            acc_hi = _mac(z0, w_hi + c0, wm, acc_hi, DOT_PREC)
            acc_hi = _mac(z1, w_hi + c0 + PW, wm, acc_hi, DOT_PREC)
        else:
            z = _fp16_at(lat_row + 2 * (c0 + offs_r[None, :]), zm).to(wd)  # [BLOCK_N, BLOCK_R]
            acc_lo = _mac(z, w_lo + c0, wm, acc_lo, DOT_PREC)
            acc_hi = _mac(z, w_hi + c0, wm, acc_hi, DOT_PREC)
    return acc_lo, acc_hi


@triton.jit
def _compressed_keys(  # type: ignore[no-untyped-def]
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
            cos, sin = _cos_sin(cos_ptr, sin_ptr, rp, comp, num_positions, HALF)
            lo, hi = lo * cos + hi * sin, hi * cos - lo * sin  # back by the row's own angle
        y_lo += lo / NREF
        y_hi += hi / NREF
    y_lo, y_hi = _key_up(
        y_lo, y_hi, lat_row, m2, wk, z_scale, z_zero, stride_w, PW, BITS, BLOCK_R, HALF,
        DOT_PREC,
    )  # fmt: skip
    if HAS_ROPE:
        at_pos = tl.load(pos_ptr + slot, mask=comp, other=0)
        cos, sin = _cos_sin(cos_ptr, sin_ptr, at_pos, comp, num_positions, HALF)
        y_lo, y_hi = y_lo * cos - y_hi * sin, y_hi * cos + y_lo * sin
    return y_lo, y_hi


@triton.jit
def _compressed_values(  # type: ignore[no-untyped-def]
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
def _latent_planes(  # type: ignore[no-untyped-def]
    lat_row, comp, z_scale, z_zero, DT: tl.constexpr, PW: tl.constexpr, BLOCK_Z: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """The tile's latents, whole: plane 0 and (INT4) plane 1 `[BLOCK_N, BLOCK_Z]` in DT,
    zero off `comp` (scale and zero load as 0 there). Channels past PW hold junk that
    the masked W_v rows multiply by 0."""
    offs_z = tl.arange(0, BLOCK_Z)[None, :]
    zm = comp & (offs_z < PW)
    if BITS == 4:
        packed = tl.load(lat_row + offs_z, mask=zm, other=0)
        z0 = ((packed & 15).to(tl.float32) * z_scale + z_zero).to(DT)
        z1 = ((packed >> 4).to(tl.float32) * z_scale + z_zero).to(DT)
    else:
        z0 = _fp16_at(lat_row + 2 * offs_z, zm).to(DT)
        z1 = z0
    return z0, z1


@triton.jit
def _project_latent(  # type: ignore[no-untyped-def]
    acc_lo, acc_hi, acc_z0, acc_z1, wv, stride_w, HALF: tl.constexpr, PW: tl.constexpr,
    BLOCK_Z: tl.constexpr, BITS: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """`acc_h + acc_z W_v^T`: the program's value accumulator `[BLOCK_G, HALF]` halves
    with the latent one up-projected (`wv`: latent channel 0 of the head's first V row)."""
    wd = wv.dtype.element_ty
    offs_z = tl.arange(0, BLOCK_Z)
    wm = (offs_z < PW)[:, None]
    w_lo = wv + tl.arange(0, HALF)[None, :] * stride_w + offs_z[:, None]  # [BLOCK_Z, HALF]
    w_hi = w_lo + HALF * stride_w
    z0 = acc_z0.to(wd)
    acc_lo = _mac(z0, w_lo, wm, acc_lo, DOT_PREC)
    acc_hi = _mac(z0, w_hi, wm, acc_hi, DOT_PREC)
    if BITS == 4:
        z1 = acc_z1.to(wd)
        acc_lo = _mac(z1, w_lo + PW, wm, acc_lo, DOT_PREC)
        acc_hi = _mac(z1, w_hi + PW, wm, acc_hi, DOT_PREC)
    return acc_lo, acc_hi


@triton.jit
def _latent_params(lat_row, comp, PW: tl.constexpr, BITS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The tile's INT4 scale and zero `[BLOCK_N, 1]` float32 (0 off `comp`, so those
    tokens' latents are 0); 1 and 0 for float16 latents."""
    if BITS == 4:
        return _fp16_at(lat_row + PW, comp), _fp16_at(lat_row + PW + 2, comp)
    else:
        return tl.full(comp.shape, 1.0, tl.float32), tl.zeros(comp.shape, tl.float32)


@triton.jit
def _fold_values(  # type: ignore[no-untyped-def]
    pd, alpha, acc_lo, acc_hi, acc_z0, acc_z1, slot, comp, num_comp, fm, at_full, lat_row,
    z_scale, z_zero, fv_head, bv_ptr, refs_ptr, stride_rs, stride_fr,
    HALF: tl.constexpr, PW: tl.constexpr, BLOCK_Z: tl.constexpr, BITS: tl.constexpr,
    NREF: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """The tile's values folded into the rescaled accumulators (`pd`: its probabilities
    `[BLOCK_G, BLOCK_N]` in the model dtype): full rows and the compressed tokens'
    references' means in head space, their latents in latent space (W_v z absorbed)."""
    dt = pd.dtype
    v_lo = tl.load(fv_head + at_full, mask=fm, other=0.0).to(dt)  # [BLOCK_N, HALF]
    v_hi = tl.load(fv_head + at_full + HALF, mask=fm, other=0.0).to(dt)
    acc_z0 = acc_z0 * alpha[:, None]
    if BITS == 4:
        acc_z1 = acc_z1 * alpha[:, None]
    if num_comp > 0:
        b_lo, b_hi = _compressed_values(
            refs_ptr, slot, comp, fv_head, bv_ptr, stride_rs, stride_fr, HALF, NREF, HAS_BIAS
        )
        v_lo = tl.where(fm, v_lo, b_lo.to(dt))
        v_hi = tl.where(fm, v_hi, b_hi.to(dt))
        z0, z1 = _latent_planes(lat_row, comp[:, None], z_scale, z_zero, dt, PW, BLOCK_Z, BITS)
        acc_z0 = tl.dot(pd, z0, acc_z0, input_precision=DOT_PREC)  # [BLOCK_G, BLOCK_Z]
        if BITS == 4:
            acc_z1 = tl.dot(pd, z1, acc_z1, input_precision=DOT_PREC)
    acc_lo = tl.dot(pd, v_lo, acc_lo * alpha[:, None], input_precision=DOT_PREC)
    acc_hi = tl.dot(pd, v_hi, acc_hi * alpha[:, None], input_precision=DOT_PREC)
    return acc_lo, acc_hi, acc_z0, acc_z1


@triton.jit
def _split_bounds(lens_ptr, s, split, num_splits, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """[start, end) of this split of sequence s's view: tile-aligned chunks."""
    length = tl.load(lens_ptr + s)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, length)


@triton.jit
def _deltakv_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr, state_ptr, latent_ptr, refs_ptr, pos_ptr, fk_ptr, fv_ptr, row_pos_ptr,
    w_ptr, b_ptr, cos_ptr, sin_ptr, table_ptr, rows_ptr, lens_ptr, ws_m_ptr, ws_l_ptr,
    ws_acc_ptr, qk_scale, num_positions,
    stride_qs, stride_qh, stride_ls, stride_rs, stride_fr, stride_w, stride_tr,
    HKV: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PW: tl.constexpr, BLOCK_Z: tl.constexpr,
    BITS: tl.constexpr, NREF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (KV head, sequence, split): online softmax of the KV head's query heads
    over one split of the view, stored as part `split` of the workspace."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    # The grid's split count, not a constexpr: one compiled kernel serves every count.
    num_splits = tl.num_programs(2)
    D: tl.constexpr = 2 * HALF
    start, end = _split_bounds(lens_ptr, s, split, num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q_at = q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_h[None, :]
    q_lo = tl.load(q_at, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, HALF]
    q_hi = tl.load(q_at + HALF, mask=g_mask[:, None], other=0.0)
    dt = q_ptr.dtype.element_ty
    wk = w_ptr + (kvh * D) * stride_w  # this head's key rows of W_up, then its value rows
    wv = w_ptr + (HKV * D + kvh * D) * stride_w
    bk_ptr = b_ptr + kvh * D
    bv_ptr = b_ptr + HKV * D + kvh * D
    fk_head = fk_ptr + kvh * D
    fv_head = fv_ptr + kvh * D
    table_row = table_ptr + tl.load(rows_ptr + s).to(tl.int64) * stride_tr

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, HALF], tl.float32)  # head space: full rows, refs' means
    acc_hi = tl.zeros([BLOCK_G, HALF], tl.float32)
    acc_z0 = tl.zeros([BLOCK_G, BLOCK_Z], tl.float32)  # latent space: sum_t p_t z_t
    acc_z1 = tl.zeros([BLOCK_G, BLOCK_Z], tl.float32)
    for j in range(start, end, BLOCK_N):
        ok = (j + offs_n) < end
        slot = tl.load(table_row + j + offs_n, mask=ok, other=0).to(tl.int64)
        st = tl.load(state_ptr + slot, mask=ok, other=-1)
        comp = st == COMPRESSED
        fm = (st >= 0)[:, None]
        num_comp = tl.sum(comp.to(tl.int32), axis=0)
        at_full = st.to(tl.int64)[:, None] * stride_fr + offs_h[None, :]
        lat_row = latent_ptr + slot[:, None] * stride_ls  # [BLOCK_N, 1]
        z_scale, z_zero = _latent_params(lat_row, comp[:, None], PW, BITS)  # [BLOCK_N, 1]

        # Keys: full rows as stored; compressed ones built only in tiles that hold some.
        k_lo = tl.load(fk_head + at_full, mask=fm, other=0.0).to(dt)  # [BLOCK_N, HALF]
        k_hi = tl.load(fk_head + at_full + HALF, mask=fm, other=0.0).to(dt)
        if num_comp > 0:
            c_lo, c_hi = _compressed_keys(
                lat_row, comp, slot, z_scale, z_zero, wk, bk_ptr, refs_ptr, fk_head,
                row_pos_ptr, pos_ptr, cos_ptr, sin_ptr, num_positions, stride_w, stride_rs,
                stride_fr, HALF, PW, BITS, BLOCK_R, NREF, HAS_BIAS, HAS_ROPE, DOT_PREC,
            )  # fmt: skip
            k_lo = tl.where(fm, k_lo, c_lo.to(dt))
            k_hi = tl.where(fm, k_hi, c_hi.to(dt))
        qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PREC)
        qk = tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=DOT_PREC)
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
        acc_lo, acc_hi, acc_z0, acc_z1 = _fold_values(
            p.to(dt), alpha, acc_lo, acc_hi, acc_z0, acc_z1, slot, comp, num_comp, fm,
            at_full, lat_row, z_scale, z_zero, fv_head, bv_ptr, refs_ptr, stride_rs,
            stride_fr, HALF, PW, BLOCK_Z, BITS, NREF, HAS_BIAS, DOT_PREC,
        )  # fmt: skip

    acc_lo, acc_hi = _project_latent(
        acc_lo, acc_hi, acc_z0, acc_z1, wv, stride_w, HALF, PW, BLOCK_Z, BITS, DOT_PREC
    )
    base = (s * (HKV * GROUP) + heads).to(tl.int64) * num_splits + split
    tl.store(ws_m_ptr + base, m_i, mask=g_mask)
    tl.store(ws_l_ptr + base, l_i, mask=g_mask)
    w_at = ws_acc_ptr + base[:, None] * D + offs_h[None, :]
    tl.store(w_at, acc_lo, mask=g_mask[:, None])
    tl.store(w_at + HALF, acc_hi, mask=g_mask[:, None])


def deltakv_num_splits(batch: int, num_kv_heads: int, max_len: int, device: torch.device) -> int:
    """Fewest splits that give ~DELTAKV_PROGRAMS_PER_SM programs per SM, within the view's
    length (DELTAKV_MIN_SPLIT_TOKENS per split) and DELTAKV_MAX_SPLITS. Depends on
    shapes only (never on the lengths' values)."""
    base = max(1, batch * num_kv_heads)
    # A power of two: on the H100 (Llama-3-8B shapes, 32K views) 50 splits took 1.56 ms
    # where 32 and 64 took 1.29 (docs/benchmarks, session 31's sweep).
    want = next_pow2(-(-DELTAKV_PROGRAMS_PER_SM * num_sms(device) // base))  # ceil
    by_len = max(1, max_len // DELTAKV_MIN_SPLIT_TOKENS)
    return max(1, min(want, by_len, DELTAKV_MAX_SPLITS))


def deltakv_decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    state: torch.Tensor,  # [num_slots] int32 (kv/deltakv.py: >= 0 full row, -2 compressed)
    latent: torch.Tensor,  # [num_slots, latent_bytes] uint8 codes (a prefix per layer)
    refs: torch.Tensor,  # [num_slots, R] int32 reference rows
    pos: torch.Tensor,  # [num_slots] int32 compressed tokens' positions
    full_k: torch.Tensor,  # [rows, Hkv, D] post-RoPE keys, the model dtype
    full_v: torch.Tensor,  # [rows, Hkv, D]
    row_pos: torch.Tensor,  # [rows] int32
    weight: torch.Tensor,  # [2 * Hkv * D, r] W_up (K rows then V rows)
    bias: torch.Tensor | None,  # [2 * Hkv * D]
    freqs: torch.Tensor | None,  # [D / 2] float32 RoPE frequencies (None: no RoPE)
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32 (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    bits: int,
    rope: RopeTable | None = None,  # rope_table(freqs, P), deltakv/rope.py
    num_splits: int | None = None,
    # The H100 sweep's best at Llama-3-8B shapes (scripts/deltakv_decode_sweep.py,
    # docs/benchmarks): 32-token tiles, 64 latent channels a step, 4 warps. 64-token
    # tiles spill 2-3x more registers and ran 2.2x slower; 8 warps spill less and run
    # 1.1x slower.
    block_n: int = 32,
    block_r: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole view in DeltaKV storage
    (module docstring); writes and returns `out` (equal to the torch reference over
    `DeltaKVStorage.read`, up to the order of float sums). `bits`: 4 for INT4 latents
    (`r / 2` code bytes then a float16 scale and zero), 16 for float16 latents. `rope`:
    the cos/sin table of `freqs` (`rope_table`); without it one of the slot table's width
    is built here, which costs a launch or two per call: callers cache it."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = full_k.shape[1]
    width = weight.shape[1]
    check_kernel_shapes(head_dim, width, bits)
    if weight.shape[0] != 2 * num_kv_heads * head_dim or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [2 * {num_kv_heads} * {head_dim}, r] row-major, got "
            f"{tuple(weight.shape)} with strides {weight.stride()}"
        )
    if num_seqs == 0:
        return out
    cos, sin = _rope_args(freqs, rope, table.shape[1], head_dim, q.device)
    if num_splits is None:
        num_splits = deltakv_num_splits(num_seqs, num_kv_heads, table.shape[1], q.device)
    ws_m, ws_l, ws_acc = split_workspace(num_seqs, num_q_heads, num_splits, head_dim, q.device)
    group = num_q_heads // num_kv_heads
    plane = width // 2 if bits == 4 else width  # latent channels per plane
    _deltakv_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, state, latent, refs, pos, full_k, full_v, row_pos, weight,
        weight if bias is None else bias, cos, sin, table, rows, view_lens,
        ws_m, ws_l, ws_acc, float(scale) * LOG2E, cos.shape[0],
        q.stride(0), q.stride(1), latent.stride(0), refs.stride(0), full_k.stride(0),
        weight.stride(0), table.stride(0),
        HKV=num_kv_heads, HALF=head_dim // 2, GROUP=group,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_R=block_r, PW=plane,
        BLOCK_Z=max(16, next_pow2(plane)), BITS=bits, NREF=refs.shape[1],
        HAS_BIAS=bias is not None, HAS_ROPE=freqs is not None, DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    merge_splits(ws_m, ws_l, ws_acc, out)
    return out


def _rope_args(
    freqs: torch.Tensor | None,
    rope: RopeTable | None,
    width: int,
    head_dim: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables the kernel reads `[P, D/2]` float32 (`rope`, else built
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
    """The shapes the kernel reads: a head of two power-of-two halves of at least 16
    channels (tensor-core operands) and an even latent (INT4 codes pair channels)."""
    if not head_dim_readable(head_dim):
        raise ValueError(
            f"the DeltaKV decode kernel needs head_dim = 2 x a power of two >= 16, got {head_dim}"
        )
    if bits not in (4, 16) or width % 2:
        raise ValueError(
            f"the DeltaKV decode kernel reads 4- or 16-bit latents of even width, got {bits} bits x {width}"
        )


def head_dim_readable(head_dim: int) -> bool:
    """Whether the kernel reads heads of `head_dim` (two power-of-two halves >= 16)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half == next_pow2(half) and half >= 16
