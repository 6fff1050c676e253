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
from sparsevllm.attention.triton.deltakv_tiles import (
    COMPRESSED,
    DeltaKVTensors,
    compressed_keys,
    compressed_values,
    fp16_at,
    latent_params,
    mac,
    rope_args,
)
from sparsevllm.attention.triton.kivi_planes import softmax_step
from sparsevllm.deltakv.rope import RopeTable

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
        z0 = fp16_at(lat_row + 2 * offs_z, zm).to(DT)
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
    acc_lo = mac(z0, w_lo, wm, acc_lo, DOT_PREC)
    acc_hi = mac(z0, w_hi, wm, acc_hi, DOT_PREC)
    if BITS == 4:
        z1 = acc_z1.to(wd)
        acc_lo = mac(z1, w_lo + PW, wm, acc_lo, DOT_PREC)
        acc_hi = mac(z1, w_hi + PW, wm, acc_hi, DOT_PREC)
    return acc_lo, acc_hi


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
        b_lo, b_hi = compressed_values(
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
        z_scale, z_zero = latent_params(lat_row, comp[:, None], PW, BITS)  # [BLOCK_N, 1]

        # Keys: full rows as stored; compressed ones built only in tiles that hold some.
        k_lo = tl.load(fk_head + at_full, mask=fm, other=0.0).to(dt)  # [BLOCK_N, HALF]
        k_hi = tl.load(fk_head + at_full + HALF, mask=fm, other=0.0).to(dt)
        if num_comp > 0:
            c_lo, c_hi = compressed_keys(
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
    t: DeltaKVTensors,
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32 (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    rope: RopeTable | None = None,  # rope_table(t.freqs, P), deltakv/rope.py
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
    `DeltaKVStorage.read`, up to the order of float sums). `rope`: the cos/sin table of
    `t.freqs` (`rope_table`); without it one of the slot table's width is built here,
    which costs a launch or two per call: callers cache it."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = t.full_k.shape[1]
    t.check(head_dim)
    if num_seqs == 0:
        return out
    cos, sin = rope_args(t.freqs, rope, table.shape[1], head_dim, q.device)
    if num_splits is None:
        num_splits = deltakv_num_splits(num_seqs, num_kv_heads, table.shape[1], q.device)
    ws_m, ws_l, ws_acc = split_workspace(num_seqs, num_q_heads, num_splits, head_dim, q.device)
    group = num_q_heads // num_kv_heads
    _deltakv_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, t.state, t.latent, t.refs, t.pos, t.full_k, t.full_v, t.row_pos, t.weight,
        t.weight if t.bias is None else t.bias, cos, sin, table, rows, view_lens,
        ws_m, ws_l, ws_acc, float(scale) * LOG2E, cos.shape[0],
        q.stride(0), q.stride(1), t.latent.stride(0), t.refs.stride(0), t.full_k.stride(0),
        t.weight.stride(0), table.stride(0),
        HKV=num_kv_heads, HALF=head_dim // 2, GROUP=group,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_N=block_n, BLOCK_R=block_r, PW=t.plane,
        BLOCK_Z=max(16, next_pow2(t.plane)), BITS=t.bits, NREF=t.refs.shape[1],
        HAS_BIAS=t.bias is not None, HAS_ROPE=t.freqs is not None,
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    merge_splits(ws_m, ws_l, ws_acc, out)
    return out
