"""Decode attention over DeltaKV storage (kv/deltakv.py), reconstructing in registers.

The torch path reads a DeltaKV view by materialising it: every compressed token's
up-projection (one GEMM over the view), an epilogue that adds its references' mean and
rotates the key, then a gathered `[L, Hkv, D]` copy of the view for attention. At 32K
tokens that is ~0.5 GB of float32 written and read again per layer and sequence. Here
one program (KV head, sequence, split) walks its split of the view in tiles of
BLOCK_N tokens and builds each tile's K and V where they are used:

    full token        K, V = its full row (post-RoPE key, as stored)
    compressed token  y = W_up z + b_up        z: the latent (INT4 codes dequantized
                                               with the token's scale and zero, or
                                               float16 values)
                      base = mean_j refs_j     the references' full rows, keys turned
                                               back to pre-RoPE at the rows' positions
                      K = rotate(y_k + base_k, pos),  V = y_v + base_v

then scores the tile against the query heads of the KV head and folds it into an
online softmax. The up map runs as tensor-core dots of the tile's latents with this
head's rows of W_up (`[2 * D, r]`, read from L2 by every tile: the cost that grows with
the context besides the references' rows). Keys are handled as two halves (channels d
and d + D/2) because rotate-half RoPE pairs them: the query is split the same way, so
a score is q_lo . k_lo + q_hi . k_hi. The tile's K and V are rounded to the model dtype
before the dots, as the torch path's view holds them.

Splits write their softmax states to a workspace merged by `merge_splits` (decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import LOG2E, auto_num_splits, dot_precision, next_pow2
from sparsevllm.attention.triton.decode import merge_splits
from sparsevllm.attention.triton.kivi_planes import softmax_step

COMPRESSED = tl.constexpr(-2)  # kv/deltakv.py's state of a compressed slot


@triton.jit
def _fp16_at(byte_ptr, mask):  # type: ignore[no-untyped-def]
    """The float16 stored little-endian at `byte_ptr` (any alignment), as float32."""
    b0 = tl.load(byte_ptr, mask=mask, other=0).to(tl.uint16)
    b1 = tl.load(byte_ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _up_half(  # type: ignore[no-untyped-def]
    lat_row, comp, w_lo, w_hi, z_scale, z_zero,
    WIDTH: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """W z for one half-pair of output channels (`w_lo`, `w_hi`: `[BLOCK_R, BLOCK_H]`
    pointers at latent channel 0 of the rows of channels d and d + D/2): `[BLOCK_N,
    BLOCK_H]` float32 each, for the tile's latents at `lat_row` `[BLOCK_N, 1]` bytes."""
    wd = w_lo.dtype.element_ty
    acc_lo = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    acc_hi = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    offs_r = tl.arange(0, BLOCK_R)
    if BITS == 4:
        # Planar INT4 (kv/kivi_codes.py): byte c holds channel c (low nibble) and channel
        # c + WIDTH / 2 (high nibble).
        PB: tl.constexpr = WIDTH // 2
        for c0 in range(0, PB, BLOCK_R):
            cm = (c0 + offs_r) < PB
            packed = tl.load(lat_row + c0 + offs_r[None, :], mask=comp & cm[None, :], other=0)
            z0 = ((packed & 15).to(tl.float32) * z_scale + z_zero).to(wd)  # [BLOCK_N, BLOCK_R]
            z1 = ((packed >> 4).to(tl.float32) * z_scale + z_zero).to(wd)
            at = (c0 + offs_r)[:, None]
            wm = cm[:, None]
            acc_lo += tl.dot(z0, tl.load(w_lo + at, mask=wm, other=0.0), input_precision=DOT_PREC)
            acc_lo += tl.dot(
                z1, tl.load(w_lo + at + PB, mask=wm, other=0.0), input_precision=DOT_PREC
            )
            acc_hi += tl.dot(z0, tl.load(w_hi + at, mask=wm, other=0.0), input_precision=DOT_PREC)
            acc_hi += tl.dot(
                z1, tl.load(w_hi + at + PB, mask=wm, other=0.0), input_precision=DOT_PREC
            )
    else:
        for c0 in range(0, WIDTH, BLOCK_R):
            cm = (c0 + offs_r) < WIDTH
            at_z = lat_row + 2 * (c0 + offs_r[None, :])
            z = _fp16_at(at_z, comp & cm[None, :]).to(wd)  # [BLOCK_N, BLOCK_R]
            at = (c0 + offs_r)[:, None]
            wm = cm[:, None]
            acc_lo += tl.dot(z, tl.load(w_lo + at, mask=wm, other=0.0), input_precision=DOT_PREC)
            acc_hi += tl.dot(z, tl.load(w_hi + at, mask=wm, other=0.0), input_precision=DOT_PREC)
    return acc_lo, acc_hi


@triton.jit
def _refs_mean(  # type: ignore[no-untyped-def]
    refs_row, comp, fk_head, fv_head, row_pos_ptr, freqs, offs_h, hm,
    stride_fr, NREF: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The mean of the references' pre-RoPE keys (lo, hi halves) and values (lo, hi):
    `[BLOCK_N, BLOCK_H]` float32 each, zero where `comp` is False."""
    k_lo = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    k_hi = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    v_lo = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    v_hi = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    m2 = comp[:, None] & hm[None, :]
    for j in tl.static_range(NREF):
        row = tl.load(refs_row + j, mask=comp, other=0).to(tl.int64)  # [BLOCK_N]
        ang = tl.load(row_pos_ptr + row, mask=comp, other=0).to(tl.float32)[:, None] * freqs
        cos, sin = tl.cos(ang), tl.sin(ang)
        at = row[:, None] * stride_fr + offs_h[None, :]
        lo = tl.load(fk_head + at, mask=m2, other=0.0).to(tl.float32)
        hi = tl.load(fk_head + at + HALF, mask=m2, other=0.0).to(tl.float32)
        k_lo += lo * cos + hi * sin  # turned back by the row's own angle
        k_hi += hi * cos - lo * sin
        v_lo += tl.load(fv_head + at, mask=m2, other=0.0).to(tl.float32)
        v_hi += tl.load(fv_head + at + HALF, mask=m2, other=0.0).to(tl.float32)
    return k_lo / NREF, k_hi / NREF, v_lo / NREF, v_hi / NREF


@triton.jit
def _full_rows_over(x_lo, x_hi, row_at, fm, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
    """The tile's halves `[BLOCK_N, BLOCK_H]` with the full tokens' rows (at `row_at`,
    where `fm`) in place of the reconstructed values."""
    lo = tl.where(fm, tl.load(row_at, mask=fm, other=0.0).to(tl.float32), x_lo)
    hi = tl.where(fm, tl.load(row_at + HALF, mask=fm, other=0.0).to(tl.float32), x_hi)
    return lo, hi


@triton.jit
def _deltakv_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr, state_ptr, latent_ptr, refs_ptr, pos_ptr, fk_ptr, fv_ptr, row_pos_ptr,
    w_ptr, b_ptr, freqs_ptr, table_ptr, rows_ptr, lens_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    qk_scale,
    stride_qs, stride_qh, stride_ls, stride_fr, stride_w, stride_tr,
    HKV: tl.constexpr, HALF: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, WIDTH: tl.constexpr,
    BITS: tl.constexpr, NREF: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (KV head, sequence, split): online softmax of the KV head's query heads
    over one split of the view, stored as part `split` of the workspace."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    D: tl.constexpr = 2 * HALF
    row = tl.load(rows_ptr + s).to(tl.int64)
    length = tl.load(lens_ptr + s)
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    hm = offs_h < HALF
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q_at = q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_h[None, :]
    qm = g_mask[:, None] & hm[None, :]
    q_lo = tl.load(q_at, mask=qm, other=0.0)  # [BLOCK_G, BLOCK_H]
    q_hi = tl.load(q_at + HALF, mask=qm, other=0.0)
    dt = q_ptr.dtype.element_ty
    freqs = tl.load(freqs_ptr + offs_h, mask=hm, other=0.0)[None, :]  # [1, BLOCK_H]
    # This head's rows of W_up, transposed to [latent channel, output channel] operands.
    w_head = w_ptr + offs_h[None, :] * stride_w
    wk_lo = w_head + (kvh * D) * stride_w
    wv_lo = w_head + (HKV * D + kvh * D) * stride_w
    if HAS_BIAS:
        bk_lo = tl.load(b_ptr + kvh * D + offs_h, mask=hm, other=0.0).to(tl.float32)[None, :]
        bk_hi = tl.load(b_ptr + kvh * D + HALF + offs_h, mask=hm, other=0.0).to(tl.float32)[None, :]
        bv_at = b_ptr + HKV * D + kvh * D + offs_h
        bv_lo = tl.load(bv_at, mask=hm, other=0.0).to(tl.float32)[None, :]
        bv_hi = tl.load(bv_at + HALF, mask=hm, other=0.0).to(tl.float32)[None, :]
    fk_head = fk_ptr + kvh * D
    fv_head = fv_ptr + kvh * D

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
    table_row = table_ptr + row * stride_tr
    for j in range(start, end, BLOCK_N):
        ok = (j + offs_n) < end
        slot = tl.load(table_row + j + offs_n, mask=ok, other=0).to(tl.int64)
        st = tl.load(state_ptr + slot, mask=ok, other=-1)
        full = st >= 0
        comp = st == COMPRESSED
        fm = full[:, None] & hm[None, :]
        at_full = st.to(tl.int64)[:, None] * stride_fr + offs_h[None, :]

        lat_row = latent_ptr + slot[:, None] * stride_ls  # [BLOCK_N, 1]
        if BITS == 4:
            z_scale = _fp16_at(lat_row + WIDTH // 2, comp[:, None])
            z_zero = _fp16_at(lat_row + WIDTH // 2 + 2, comp[:, None])
        else:
            z_scale = tl.full([BLOCK_N, 1], 1.0, tl.float32)
            z_zero = tl.zeros([BLOCK_N, 1], tl.float32)
        base_k_lo, base_k_hi, base_v_lo, base_v_hi = _refs_mean(
            refs_ptr + slot * NREF, comp, fk_head, fv_head, row_pos_ptr, freqs, offs_h, hm,
            stride_fr, NREF, HALF, BLOCK_N, BLOCK_H,
        )  # fmt: skip

        # Keys: reconstructed, rotated at the token's position; full rows as stored.
        y_lo, y_hi = _up_half(
            lat_row, comp[:, None], wk_lo, wk_lo + HALF * stride_w, z_scale, z_zero,
            WIDTH, BITS, BLOCK_R, BLOCK_N, BLOCK_H, DOT_PREC,
        )  # fmt: skip
        pre_lo = y_lo + base_k_lo
        pre_hi = y_hi + base_k_hi
        if HAS_BIAS:
            pre_lo += bk_lo
            pre_hi += bk_hi
        ang = tl.load(pos_ptr + slot, mask=comp, other=0).to(tl.float32)[:, None] * freqs
        cos, sin = tl.cos(ang), tl.sin(ang)
        k_lo = pre_lo * cos - pre_hi * sin
        k_hi = pre_hi * cos + pre_lo * sin
        k_lo, k_hi = _full_rows_over(k_lo, k_hi, fk_head + at_full, fm, HALF)
        qk = tl.dot(q_lo, tl.trans(k_lo.to(dt)), input_precision=DOT_PREC)
        qk += tl.dot(q_hi, tl.trans(k_hi.to(dt)), input_precision=DOT_PREC)
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)

        # Values: reconstructed, or the full rows.
        y_lo, y_hi = _up_half(
            lat_row, comp[:, None], wv_lo, wv_lo + HALF * stride_w, z_scale, z_zero,
            WIDTH, BITS, BLOCK_R, BLOCK_N, BLOCK_H, DOT_PREC,
        )  # fmt: skip
        v_lo = y_lo + base_v_lo
        v_hi = y_hi + base_v_hi
        if HAS_BIAS:
            v_lo += bv_lo
            v_hi += bv_hi
        v_lo, v_hi = _full_rows_over(v_lo, v_hi, fv_head + at_full, fm, HALF)
        pd = p.to(dt)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(pd, v_lo.to(dt), input_precision=DOT_PREC)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(pd, v_hi.to(dt), input_precision=DOT_PREC)

    base = (s * (HKV * GROUP) + heads) * NUM_SPLITS + split
    base = base.to(tl.int64)
    tl.store(ws_m_ptr + base, m_i, mask=g_mask)
    tl.store(ws_l_ptr + base, l_i, mask=g_mask)
    w_at = ws_acc_ptr + base[:, None] * D + offs_h[None, :]
    tl.store(w_at, acc_lo, mask=qm)
    tl.store(w_at + HALF, acc_hi, mask=qm)


def deltakv_decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    state: torch.Tensor,  # [num_slots] int32 (kv/deltakv.py: >= 0 full row, -2 compressed)
    latent: torch.Tensor,  # [num_slots, latent_bytes] uint8 codes (a prefix per layer)
    refs: torch.Tensor,  # [num_slots, R] int32 reference rows
    pos: torch.Tensor,  # [num_slots] int32 compressed tokens' positions
    full_k: torch.Tensor,  # [rows, Hkv, D] post-RoPE keys, the model dtype
    full_v: torch.Tensor,  # [rows, Hkv, D]
    row_pos: torch.Tensor,  # [rows] int32
    weight: torch.Tensor,  # [2 * Hkv * D, r] W_up (K rows then V rows), the model dtype
    bias: torch.Tensor | None,  # [2 * Hkv * D]
    freqs: torch.Tensor | None,  # [D / 2] float32 RoPE frequencies (None: no RoPE)
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32 (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    bits: int,
    num_splits: int | None = None,
    block_n: int = 32,
    block_r: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole view in DeltaKV storage
    (module docstring); writes and returns `out` (equal to the torch reference over
    `DeltaKVStorage.read`, up to the order of float sums). `bits`: 4 for INT4 latents
    (`r / 2` code bytes then a float16 scale and zero), 16 for float16 latents."""
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
    if num_splits is None:
        num_splits = auto_num_splits(num_seqs, num_kv_heads, table.shape[1], q.device)
    ws_m = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty((*ws_m.shape, head_dim), dtype=torch.float32, device=q.device)
    group = num_q_heads // num_kv_heads
    if freqs is None:
        freqs = torch.zeros(head_dim // 2, dtype=torch.float32, device=q.device)
    _deltakv_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, state, latent, refs, pos, full_k, full_v, row_pos, weight,
        weight if bias is None else bias, freqs.float().contiguous(), table, rows, view_lens,
        ws_m, ws_l, ws_acc, float(scale) * LOG2E,
        q.stride(0), q.stride(1), latent.stride(0), full_k.stride(0), weight.stride(0),
        table.stride(0),
        HKV=num_kv_heads, HALF=head_dim // 2, GROUP=group,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_H=head_dim // 2,
        BLOCK_R=block_r, WIDTH=width, BITS=bits, NREF=refs.shape[1],
        HAS_BIAS=bias is not None, NUM_SPLITS=num_splits, DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    merge_splits(ws_m, ws_l, ws_acc, out)
    return out


def check_kernel_shapes(head_dim: int, width: int, bits: int) -> None:
    """The shapes the kernel reads: a head of two power-of-two halves of at least 16
    channels (tensor-core operands) and an even latent (INT4 codes pair channels)."""
    half = head_dim // 2
    if head_dim % 2 or half != next_pow2(half) or half < 16:
        raise ValueError(
            f"the DeltaKV decode kernel needs head_dim = 2 x a power of two >= 16, got {head_dim}"
        )
    if bits not in (4, 16) or width % 2:
        raise ValueError(
            f"the DeltaKV decode kernel reads 4- or 16-bit latents of even width, got {bits} bits x {width}"
        )
