"""Decode attention over KIVI storage (kv/kivi.py): packed 4- or 2-bit codes dequantized
in registers, the residual window read in full precision.

The same split-K, GQA-packed scheme as decode.py (one program per sequence x KV head x
split of the view; decode.py's merge kernel combines the splits). Per tile of BLOCK_N
view entries the program loads each slot's `state`: a sealed slot's codes are read, a
residual slot's full-precision row (masked loads: a slot costs the bytes of one).

Codes are planar (kv/kivi_codes.py): channel d is byte d % P of the row at bit
bits * (d // P), so a tile's codes come from contiguous, wide loads of its rows (each
byte loaded once per plane, from L1) and one shift per element. Nothing is dequantized
element by element where it can be folded:

* keys of a tile sealed in one key group (the common case: a view is sealed in order,
  G tokens to a group): `q . (c * s + z) = (q * s) . c + q . z`, the group's
  per-channel scale folded into the query; other tiles dequantize each key element;
* values (one scale and zero point per token and head): the scale scales the token's
  probability before P @ codes, and the zero points add `sum(p * z)` to every channel.

CUDA-graph capturable: no host sync, buffers sized from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import LOG2E, auto_num_splits, dot_precision, next_pow2
from sparsevllm.attention.triton.decode import merge_splits


@triton.jit
def _biased_codes(packed, shift, BITS: tl.constexpr, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Codes `[BLOCK_N, D]` of packed bytes (planar: `shift` per channel) as DT values
    plus `_code_bias(DT)`: in bf16 (fp16) the number 128 + code (1024 + code) is built
    from its bits, the bias's exponent OR the code in the low mantissa bits, with no
    int-to-float conversion; the dot's excess, bias x the other operand's sum, is
    subtracted once per row."""
    c = (packed.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)
    if DT == tl.bfloat16:
        return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float16:
        return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return c.to(DT)


@triton.jit
def _code_bias(DT: tl.constexpr):  # type: ignore[no-untyped-def]
    # The smallest power of two whose mantissa unit is 1: bf16 (7 bits) 128, fp16 1024.
    if DT == tl.bfloat16:
        return 128.0
    elif DT == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def _kivi_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_codes_ptr,
    v_codes_ptr,
    v_par_ptr,
    state_ptr,
    groups_ptr,
    res_k_ptr,
    res_v_ptr,
    table_ptr,
    rows_ptr,
    lens_ptr,
    out_ptr,
    ws_m_ptr,
    ws_l_ptr,
    ws_acc_ptr,
    qk_scale,
    num_groups,
    stride_qs,
    stride_qh,
    stride_cs,  # codes [num_slots, Hkv, P] (K and V alike)
    stride_ch,
    stride_ps,  # value parameters [num_slots, Hkv, 2]
    stride_ph,
    stride_gg,  # key groups [num_groups, Hkv, D, 2]
    stride_gh,
    stride_rs,  # residual rows [rows, Hkv, D]
    stride_rh,
    stride_tr,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (KV head, s, split): online softmax over one split of the view."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(0) * GROUP
    P: tl.constexpr = HEAD_DIM * BITS // 8  # bytes of one packed row (a plane's channels)

    row = tl.load(rows_ptr + s).to(tl.int64)
    view_len = tl.load(lens_ptr + s)
    chunk = tl.cdiv(tl.cdiv(view_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, view_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    # Channel d's code: byte d % P of the row, bits BITS * (d // P) (planar packing). A
    # byte is loaded once per plane, from L1: contiguous runs of P keep the loads wide.
    byte_d = offs_d % P
    shift = (offs_d // P) * BITS  # [HEAD_DIM]
    q = tl.load(
        q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, HEAD_DIM]
    qd = q_ptr.dtype.element_ty
    bias = _code_bias(qd)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    zacc = tl.zeros([BLOCK_G], tl.float32)  # sum of p * value zero points
    table_row = table_ptr + row * stride_tr
    code_head = kvh * stride_ch + byte_d[None, :]
    par_head = v_par_ptr + kvh * stride_ph
    group_head = groups_ptr + kvh * stride_gh + offs_d * 2
    # Each iteration issues the next tile's loads before its own math (the loop's data-
    # dependent branches keep Triton's pipeliner out): table -> slots -> state, codes and
    # value parameters, and the next tile's first key group.
    valid = (start + offs_n) < end
    slot = tl.load(table_row + start + offs_n, mask=valid, other=0).to(tl.int64)
    st = tl.load(state_ptr + slot, mask=valid, other=-1)
    kb = tl.load(k_codes_ptr + slot[:, None] * stride_cs + code_head, mask=valid[:, None], other=0)
    vb = tl.load(v_codes_ptr + slot[:, None] * stride_cs + code_head, mask=valid[:, None], other=0)
    v_scale = tl.load(par_head + slot * stride_ps, mask=valid, other=0.0)
    v_zero = tl.load(par_head + slot * stride_ps + 1, mask=valid, other=0.0)
    g_lo = tl.min(tl.where(valid & (st >= 0), st, 2**30), 0).to(tl.int64)
    g_scale = tl.load(group_head + tl.minimum(g_lo, num_groups - 1) * stride_gg)
    g_zero = tl.load(group_head + tl.minimum(g_lo, num_groups - 1) * stride_gg + 1)
    for j in range(start, end, BLOCK_N):
        nxt = j + BLOCK_N + offs_n
        valid_nx = nxt < end
        slot_nx = tl.load(table_row + nxt, mask=valid_nx, other=0).to(tl.int64)
        st_nx = tl.load(state_ptr + slot_nx, mask=valid_nx, other=-1)
        at_nx = slot_nx[:, None] * stride_cs + code_head
        kb_nx = tl.load(k_codes_ptr + at_nx, mask=valid_nx[:, None], other=0)
        vb_nx = tl.load(v_codes_ptr + at_nx, mask=valid_nx[:, None], other=0)
        v_scale_nx = tl.load(par_head + slot_nx * stride_ps, mask=valid_nx, other=0.0)
        v_zero_nx = tl.load(par_head + slot_nx * stride_ps + 1, mask=valid_nx, other=0.0)

        sealed = valid & (st >= 0)
        resid = valid & (st <= -2)
        gid = tl.maximum(st, 0).to(tl.int64)
        rrow = tl.maximum(-st - 2, 0).to(tl.int64)
        n_res = tl.sum(resid.to(tl.int32), 0)
        g_hi = tl.max(tl.where(sealed, gid, -1), 0)
        if (n_res == 0) & (g_lo == g_hi):
            # One key group: q . (c * s + z) = (q * s) . c + q . z
            q_s = (q * g_scale.to(tl.float32)[None, :]).to(qd)
            k_biased = _biased_codes(kb, shift, BITS, qd)  # [BLOCK_N, D]: bias + code
            qk = tl.dot(q_s, tl.trans(k_biased), input_precision=DOT_PREC)
            excess = bias * tl.sum(q_s.to(tl.float32), 1) - tl.sum(
                q * g_zero.to(tl.float32)[None, :], 1
            )
            qk -= excess[:, None]
        else:
            k_int = (kb.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)
            m2 = sealed[:, None]
            gp = group_head[None, :] + gid[:, None] * stride_gg
            t_scale = tl.load(gp, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_N, HEAD_DIM]
            t_zero = tl.load(gp + 1, mask=m2, other=0.0).to(tl.float32)
            k_res = tl.load(
                res_k_ptr + rrow[:, None] * stride_rs + kvh * stride_rh + offs_d[None, :],
                mask=resid[:, None],
                other=0.0,
            ).to(tl.float32)
            k = tl.where(m2, k_int.to(tl.float32) * t_scale + t_zero, k_res).to(qd)
            qk = tl.dot(q.to(qd), tl.trans(k), input_precision=DOT_PREC)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Values: a sealed token's scale folds into its probability, its zero point into
        # zacc; a residual token's full-precision row is read as it is.
        v_s = tl.where(sealed, v_scale.to(tl.float32), 0.0)
        v_z = tl.where(sealed, v_zero.to(tl.float32), 0.0)
        v_codes = _biased_codes(vb, shift, BITS, qd)  # [BLOCK_N, D]: bias + code
        p_s = (p * v_s[None, :]).to(qd)
        pv = tl.dot(p_s, v_codes, input_precision=DOT_PREC)
        pv -= (bias * tl.sum(p_s.to(tl.float32), 1))[:, None]
        if n_res > 0:
            v_res = tl.load(
                res_v_ptr + rrow[:, None] * stride_rs + kvh * stride_rh + offs_d[None, :],
                mask=resid[:, None],
                other=0.0,
            ).to(qd)
            p_res = tl.where(resid[None, :], p, 0.0).to(qd)
            pv += tl.dot(p_res, v_res, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        zacc = zacc * alpha + tl.sum(p * v_z[None, :], 1)
        m_i = m_new

        valid, slot, st, kb, vb = valid_nx, slot_nx, st_nx, kb_nx, vb_nx
        v_scale, v_zero = v_scale_nx, v_zero_nx
        g_lo = tl.min(tl.where(valid & (st >= 0), st, 2**30), 0).to(tl.int64)
        g_scale = tl.load(group_head + tl.minimum(g_lo, num_groups - 1) * stride_gg)
        g_zero = tl.load(group_head + tl.minimum(g_lo, num_groups - 1) * stride_gg + 1)

    acc += zacc[:, None]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptr = out_ptr + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        base = ((s * num_q_heads + heads) * NUM_SPLITS + split).to(tl.int64)
        tl.store(ws_m_ptr + base, m_i, mask=g_mask)
        tl.store(ws_l_ptr + base, l_i, mask=g_mask)
        tl.store(ws_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])


def kivi_decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    k_codes: torch.Tensor,  # [num_slots, Hkv, D * bits / 8] uint8
    v_codes: torch.Tensor,  # [num_slots, Hkv, D * bits / 8] uint8
    v_params: torch.Tensor,  # [num_slots, Hkv, 2] float16
    state: torch.Tensor,  # [num_slots] int32 (kv/kivi.py)
    key_groups: torch.Tensor,  # [num_groups, Hkv, D, 2] float16
    res_k: torch.Tensor,  # [rows, Hkv, D] model dtype
    res_v: torch.Tensor,  # [rows, Hkv, D]
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32 (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    bits: int,
    num_splits: int | None = None,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole view in KIVI storage;
    writes and returns `out` (equal to the torch reference over `KiviStorage.read`)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_codes.shape[1]
    if k_codes.shape[2] * 8 // bits != head_dim:
        raise ValueError(f"codes {tuple(k_codes.shape)} do not hold {bits}-bit rows of {head_dim}")
    if head_dim != next_pow2(head_dim) or head_dim < 16:
        raise ValueError(
            f"the KIVI decode kernel needs a power-of-two head_dim >= 16, got {head_dim}"
        )
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes), ("res_k", res_k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dimension")
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = auto_num_splits(num_seqs, num_kv_heads, table.shape[1], q.device)
    ws_m = ws_l = ws_acc = None
    if num_splits > 1:
        ws_m = torch.empty(
            (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((*ws_m.shape, head_dim), dtype=torch.float32, device=q.device)
    group = num_q_heads // num_kv_heads
    _kivi_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_codes, v_codes, v_params, state, key_groups, res_k, res_v,
        table, rows, view_lens, out, ws_m, ws_l, ws_acc,
        float(scale) * LOG2E,
        key_groups.shape[0],
        q.stride(0), q.stride(1),
        k_codes.stride(0), k_codes.stride(1),
        v_params.stride(0), v_params.stride(1),
        key_groups.stride(0), key_groups.stride(1),
        res_k.stride(0), res_k.stride(1),
        table.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BITS=bits,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        assert ws_m is not None and ws_l is not None and ws_acc is not None
        merge_splits(ws_m, ws_l, ws_acc, out)
    return out
