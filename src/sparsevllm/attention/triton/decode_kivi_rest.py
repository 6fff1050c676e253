"""The KIVI decode kernel's second part: each view's entries after its leading one-group
tiles (residual rows, tiles spanning key groups, re-grouped entries), one program per
KV head x sequence, as one more split for merge_splits.

Every entry is dequantized with its own parameters (its key group's, its own value
scale and zero point) or read from its full-precision residual row. These loads and
their per-entry parameters need many more registers than the one-group tiles of
decode_kivi.py; in a kernel of their own they no longer cap that kernel's occupancy.
A view's rest is short (the newest R tokens, and tiles a compaction left misaligned).

CUDA-graph capturable: no host sync, buffers sized from shapes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sparsevllm.attention.triton.kivi_planes import (
    any_plane,
    query_planes,
    softmax_step,
    store_partial,
)


@triton.jit
def _rest_qk(q0, q1, q2, q3, kb, st, gp, rk, P: tl.constexpr, BITS: tl.constexpr, NPL: tl.constexpr, qd: tl.constexpr, DOT_PREC: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
    """Logits `[BLOCK_G, BLOCK_N]` of a tile whose keys are dequantized entry by entry."""
    k0 = any_plane(kb, st, gp, rk, 0, 0, P, BITS, True).to(qd)  # [BLOCK_N, P]
    qk = tl.dot(q0.to(qd), tl.trans(k0), input_precision=DOT_PREC)
    k1 = any_plane(kb, st, gp, rk, 1, 0, P, BITS, True).to(qd)
    qk += tl.dot(q1.to(qd), tl.trans(k1), input_precision=DOT_PREC)
    if NPL == 4:
        k2 = any_plane(kb, st, gp, rk, 2, 0, P, BITS, True).to(qd)
        qk += tl.dot(q2.to(qd), tl.trans(k2), input_precision=DOT_PREC)
        k3 = any_plane(kb, st, gp, rk, 3, 0, P, BITS, True).to(qd)
        qk += tl.dot(q3.to(qd), tl.trans(k3), input_precision=DOT_PREC)
    return qk


@triton.jit
def kivi_rest_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr, k_codes_ptr, v_codes_ptr, v_par_ptr, state_ptr, groups_ptr, res_k_ptr, res_v_ptr,
    table_ptr, rows_ptr, lens_ptr, fast_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, qk_scale,
    stride_qs, stride_qh,
    stride_cs, stride_ch,  # codes [num_slots, Hkv, P] (K and V alike)
    stride_ps, stride_ph,  # value parameters [num_slots, Hkv] int32 (scale, zero)
    stride_gg, stride_gh,  # key groups [num_groups, Hkv, D] int32 (scale, zero)
    stride_rs, stride_rh,  # residual rows [rows, Hkv, D]
    stride_tr,
    HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NUM_PARTS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (KV head, s): online softmax over the view's entries from `fast[s]` on,
    stored as part `SPLIT` of `NUM_PARTS` in the split workspace."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    num_q_heads = tl.num_programs(0) * GROUP
    P: tl.constexpr = HEAD_DIM * BITS // 8
    NPL: tl.constexpr = 8 // BITS
    row = tl.load(rows_ptr + s).to(tl.int64)
    end = tl.load(lens_ptr + s)
    start = tl.load(fast_ptr + s)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, P)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q_at = q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_p[None, :]
    q0, q1, q2, q3 = query_planes(q_at, g_mask, P, NPL)  # [BLOCK_G, P] each
    qd = q_ptr.dtype.element_ty
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc0 = tl.zeros([BLOCK_G, P], tl.float32)  # output channels 0 .. P-1, and so on
    acc1 = tl.zeros([BLOCK_G, P], tl.float32)
    acc2 = tl.zeros([BLOCK_G, P], tl.float32)
    acc3 = tl.zeros([BLOCK_G, P], tl.float32)
    table_row = table_ptr + row * stride_tr
    k_head = k_codes_ptr + kvh * stride_ch + offs_p[None, :]
    v_head = v_codes_ptr + kvh * stride_ch + offs_p[None, :]
    par_head = v_par_ptr + kvh * stride_ph
    group_head = groups_ptr + kvh * stride_gh
    for j in range(start, end, BLOCK_N):
        valid = (j + offs_n) < end
        slot = tl.load(table_row + j + offs_n, mask=valid, other=0).to(tl.int64)
        st = tl.load(state_ptr + slot, mask=valid, other=-1)  # [BLOCK_N]
        gp = group_head + tl.maximum(st, 0).to(tl.int64) * stride_gg  # [BLOCK_N]
        rrow = tl.maximum(-st - 2, 0).to(tl.int64) * stride_rs + kvh * stride_rh
        kb = tl.load(k_head + slot[:, None] * stride_cs, mask=valid[:, None], other=0)
        qk = _rest_qk(q0, q1, q2, q3, kb, st, gp, res_k_ptr + rrow, P, BITS, NPL, qd, DOT_PREC)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
        vw = tl.load(par_head + slot * stride_ps, mask=valid, other=0)
        vb = tl.load(v_head + slot[:, None] * stride_cs, mask=valid[:, None], other=0)
        rv = res_v_ptr + rrow
        pq = p.to(qd)
        v0 = any_plane(vb, st, gp, rv, 0, vw, P, BITS, False).to(qd)
        acc0 = acc0 * alpha[:, None] + tl.dot(pq, v0, input_precision=DOT_PREC)
        v1 = any_plane(vb, st, gp, rv, 1, vw, P, BITS, False).to(qd)
        acc1 = acc1 * alpha[:, None] + tl.dot(pq, v1, input_precision=DOT_PREC)
        if NPL == 4:
            v2 = any_plane(vb, st, gp, rv, 2, vw, P, BITS, False).to(qd)
            acc2 = acc2 * alpha[:, None] + tl.dot(pq, v2, input_precision=DOT_PREC)
            v3 = any_plane(vb, st, gp, rv, 3, vw, P, BITS, False).to(qd)
            acc3 = acc3 * alpha[:, None] + tl.dot(pq, v3, input_precision=DOT_PREC)
    base = ((s * num_q_heads + heads) * NUM_PARTS + SPLIT).to(tl.int64)
    zero = tl.zeros([BLOCK_G], tl.float32)
    store_partial(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, base, g_mask, m_i, l_i, zero,
        acc0, acc1, acc2, acc3, HEAD_DIM, P, NPL,
    )  # fmt: skip
