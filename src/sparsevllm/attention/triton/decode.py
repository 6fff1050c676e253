"""Decode attention over slot tables: GQA-packed, split-K (flash-decoding).

One query per sequence attends its whole view (or a per-KV-head subset of it plus its
own token). Work is split three ways: sequence x KV head x split of the view.

* GQA packing: a program serves all G query heads of one KV head, so every K/V tile is
  loaded once per KV head and scored as a [G, BLOCK_N] tile (G padded to 16, the
  smallest tensor-core M; decode is memory bound, so the padded FLOPs are free).
* Split-K: each sequence's (effective) view is cut into `num_splits` equal parts; each
  part writes its partial (max, sum, acc) to an fp32 workspace and a second kernel
  merges them. With one split the first kernel writes the output directly.
* Sliding window (optional, no subset): only the last `window` view entries are read.
* Quantized caches (int8 / float8_e4m3fn elements with per-token, per-head scales):
  the elements are converted to the query's dtype in registers (exactly: int8 and e4m3
  values fit bf16, fp16 and fp32), the dots run in that dtype, and the scales fold into
  the logit columns (K) and the probabilities before P@V (V), not into every element.
* Scores (optional): the first pass stores each tile's base-2 logits into `scores_out`
  and the merge writes each head's log-sum-exp; a third, elementwise kernel turns the
  logits into probabilities in place. Extra cost: S * Hq * max_len * 4 bytes written
  twice and read once (vs. re-reading K, Hkv * D * 2 bytes per position, which is ~5x
  more for Llama-3-8B shapes).

CUDA-graph capturable: no host sync, and every buffer is sized from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    LOG2E,
    auto_num_splits,
    check_attention_args,
    check_kv_scales,
    check_last_dim_contiguous,
    dot_precision,
    next_pow2,
    scale_launch_args,
    split_workspace,
)


@triton.jit
def _decode_partial_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    rows_ptr,
    lens_ptr,
    subset_ptr,
    subset_lens_ptr,
    out_ptr,
    ws_m_ptr,
    ws_l_ptr,
    ws_acc_ptr,
    lse_ptr,
    scores_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    qk_scale,
    window,
    stride_qs,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_tr,
    stride_ss,
    stride_sh,
    stride_sls,
    stride_slh,
    stride_os,
    stride_oh,
    stride_scs,
    stride_sch,
    subset_cap,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SUBSET: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Program (s, kv head, split): online softmax over one split of the view."""
    if HEADS_FASTEST:
        # The KV heads of one (sequence, split) are neighbouring programs and run
        # together over the same slot rows (measured on the H200: no faster than
        # sequences first, docs/benchmarks/h200/split_sweep.json; kept for the sweep).
        kvh = tl.program_id(0)
        s = tl.program_id(1)
        num_q_heads = tl.num_programs(0) * GROUP
    else:
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        num_q_heads = tl.num_programs(1) * GROUP
    split = tl.program_id(2)

    row = tl.load(rows_ptr + s).to(tl.int64)
    view_len = tl.load(lens_ptr + s)
    if HAS_SUBSET:
        # Effective sequence: subset[0 : n_sel] then the query's own token (view_len - 1).
        # A negative count reads the whole view: positions 0 .. view_len - 2 in order.
        # Counts are per sequence (stride_slh 0) or per sequence and KV head.
        sub_len = tl.load(subset_lens_ptr + s * stride_sls + kvh * stride_slh)
        whole = sub_len < 0
        n_sel = tl.where(whole, view_len - 1, tl.minimum(sub_len, subset_cap))
        eff_len = tl.where(view_len > 0, n_sel + 1, 0)
        view_lo = 0
    else:
        # A sliding layer reads the view's last `window` entries: [view_lo, view_len).
        view_lo = tl.where(window > 0, tl.maximum(view_len - window, 0), 0)
        eff_len = view_len - view_lo
    # Split bounds rounded to whole tiles so only each split's last tile is ragged.
    chunk = tl.cdiv(tl.cdiv(eff_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, eff_len)

    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this KV head
    q = tl.load(
        q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]; padded heads are 0 -> finite logits, never stored
    if not QUANT:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = table_ptr + row * stride_tr
    k_base = k_cache_ptr + kvh * stride_kch
    v_base = v_cache_ptr + kvh * stride_vch
    ks_base = k_scale_ptr + kvh * stride_ksh  # a dummy without QUANT, never read
    vs_base = v_scale_ptr + kvh * stride_vsh
    # Every tile of [start, end) holds >= 1 valid key, so m_i is finite after the first.
    for j in range(start, end, BLOCK_N):
        offs = j + offs_n  # [BLOCK_N] indices into the effective sequence
        valid = offs < end
        if HAS_SUBSET:
            sub = subset_ptr + s.to(tl.int64) * stride_ss + kvh * stride_sh
            pos = tl.load(sub + offs, mask=valid & (offs < n_sel) & (sub_len >= 0), other=0)
            pos = tl.where(whole, offs, pos)
            pos = tl.where(offs == n_sel, view_len - 1, pos)  # view positions
        else:
            pos = view_lo + offs
        slot = tl.load(table_row + pos, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_base + slot[:, None] * stride_kcs + offs_d[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if QUANT:
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_G, BLOCK_N]
        if QUANT:
            # Key n's scale scales logit column n. Masked: slot 0 pads invalid positions.
            k_sc = tl.load(ks_base + slot * stride_kss, mask=valid, other=0.0)  # [BLOCK_N]
            qk = qk * (k_sc * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        if WRITE_SCORES:
            sc = scores_ptr + s.to(tl.int64) * stride_scs + heads[:, None] * stride_sch
            tl.store(sc + pos[None, :], qk, mask=g_mask[:, None] & valid[None, :])
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + slot[:, None] * stride_vcs + offs_d[None, :], mask=kv_mask, other=0.0
        )  # [BLOCK_N, BLOCK_D]
        if QUANT:
            # Value n's scale scales probability column n (l_i keeps the unscaled sum).
            v_sc = tl.load(vs_base + slot * stride_vss, mask=valid, other=0.0)  # [BLOCK_N]
            pv = (p * v_sc[None, :]).to(q.dtype)
            v = v.to(q.dtype)
        else:
            pv = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # empty view (padding row): output zeros
        o = acc / l_safe[:, None]
        o_ptr = out_ptr + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh
        tl.store(
            o_ptr + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
        if WRITE_SCORES:
            tl.store(lse_ptr + s * num_q_heads + heads, m_i + tl.log2(l_safe), mask=g_mask)
    else:
        # Workspace [S, Hq, NUM_SPLITS(, BLOCK_D)]; an empty split stores (-inf, 0, 0).
        base = ((s * num_q_heads + heads) * NUM_SPLITS + split).to(tl.int64)  # [BLOCK_G]
        tl.store(ws_m_ptr + base, m_i, mask=g_mask)
        tl.store(ws_l_ptr + base, l_i, mask=g_mask)
        tl.store(ws_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_merge_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    ws_m_ptr,
    ws_l_ptr,
    ws_acc_ptr,
    out_ptr,
    lse_ptr,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
):
    """Program (s, query head): merge the splits' partial softmax states."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    offs_sp = tl.arange(0, BLOCK_SPLITS)  # [BLOCK_SPLITS]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    sp_mask = offs_sp < NUM_SPLITS
    base = (s * num_q_heads + h).to(tl.int64) * NUM_SPLITS + offs_sp  # [BLOCK_SPLITS]
    m = tl.load(ws_m_ptr + base, mask=sp_mask, other=float("-inf"))
    l_part = tl.load(ws_l_ptr + base, mask=sp_mask, other=0.0)
    acc = tl.load(
        ws_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], mask=sp_mask[:, None], other=0.0
    )  # [BLOCK_SPLITS, BLOCK_D]
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty: avoid inf - inf
    w = tl.exp2(m - m_max)  # [BLOCK_SPLITS]; 0 for empty splits
    l_tot = tl.sum(w * l_part, 0)
    l_safe = tl.where(l_tot > 0, l_tot, 1.0)
    o = tl.sum(acc * w[:, None], 0) / l_safe  # [BLOCK_D]
    o_ptr = out_ptr + s.to(tl.int64) * stride_os + h * stride_oh + offs_d
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
    if WRITE_SCORES:
        tl.store(lse_ptr + s * num_q_heads + h, m_max + tl.log2(l_safe))


@triton.jit
def _scores_normalize_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    scores_ptr,
    lse_ptr,
    lens_ptr,
    stride_scs,
    stride_sch,
    max_len,
    BLOCK: tl.constexpr,
):
    """Program (s, query head, block of positions): logits -> probabilities, zero padding."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    view_len = tl.load(lens_ptr + s)
    lse = tl.load(lse_ptr + s * tl.num_programs(1) + h)
    ptr = scores_ptr + s.to(tl.int64) * stride_scs + h * stride_sch + offs
    in_view = offs < view_len
    x = tl.load(ptr, mask=in_view, other=float("-inf"))
    tl.store(ptr, tl.where(in_view, tl.exp2(x - lse), 0.0), mask=offs < max_len)


def decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32 table row of each sequence
    view_lens: torch.Tensor,  # [S] int32 view length (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, Hq, D]
    *,
    subset: torch.Tensor | None = None,  # [S, Hkv, B] int32 ascending view positions
    subset_lens: torch.Tensor | None = None,  # [S] or [S, Hkv] int32 valid entries
    scores_out: torch.Tensor | None = None,  # [S, Hq, max_len] float32
    window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    heads_fastest: bool = True,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
    v_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
) -> torch.Tensor:
    """Attention of each sequence's single query over its view; writes and returns `out`.

    With `subset`, sequence s reads view[subset[s, h, :subset_lens[s]]] for KV head h plus
    always its own token (view position view_lens[s] - 1), as torch_ref.gather_selected;
    a negative subset_lens[s] reads s's whole view (no subset for that sequence).
    `subset_lens` `[S, Hkv]` gives each KV head its own count (subset_lens[s, h]).
    With `scores_out`, row [s, h, :view_lens[s]] receives head h's softmax probabilities
    over view positions (under a subset: nonzero only at the positions read; a position
    listed twice shows one occurrence's share) and the rest of the row is zeroed.
    `window` (sliding-window layers, not with `subset`): read only the last `window`
    view entries (scores elsewhere are 0).
    `num_splits=None` picks the split count from shapes (see `auto_num_splits`);
    `block_n`, `num_warps`, `num_stages` tune the split kernel; `heads_fastest=False`
    launches sequences as the fastest grid dimension (the old order, for benchmarks).
    `k_scale`/`v_scale` go with (and only with) an int8 or float8_e4m3fn cache: value =
    element * scale of its (slot, KV head), as kv.scaled.dequantize.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    q = check_attention_args(q, k_cache, v_cache, table, out)
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if (subset is None) != (subset_lens is None):
        raise ValueError("subset and subset_lens go together")
    if window is not None and (subset is not None or window < 1):
        raise ValueError("window must be >= 1 and cannot be combined with a subset")
    if num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    max_len = table.shape[1]
    if subset is not None:
        if subset.shape[:2] != (num_seqs, num_kv_heads) or subset.stride(2) != 1:
            raise ValueError(f"subset must be [S, Hkv, B] with contiguous B, got {subset.shape}")
        eff_max = subset.shape[2] + 1
        assert subset_lens is not None
        if subset_lens.shape not in ((num_seqs,), (num_seqs, num_kv_heads)):
            raise ValueError(f"subset_lens must be [S] or [S, Hkv], got {subset_lens.shape}")
    else:
        eff_max = max_len
    if num_splits is None:
        num_splits = auto_num_splits(num_seqs, num_kv_heads, eff_max, q.device)
    num_splits = max(1, int(num_splits))
    block_d = next_pow2(max(head_dim, 16))
    # Tiles from docs/benchmarks/h200/decode_tile_sweep.json (Triton 3.6, 5 shapes from
    # 1 x 32K to 128 x 2K): 3 stages beat 2 on every shape (1.14x-1.8x); 1-byte elements
    # take 128-key tiles (the same bytes per tile as 64 bf16 keys; 1.13x-2.0x).
    block_n = block_n or (32 if block_d > 128 else 128 if quantized else 64)
    write_scores = scores_out is not None
    lse: torch.Tensor | None = None
    if scores_out is not None:
        if (
            scores_out.shape != (num_seqs, num_q_heads, max_len)
            or scores_out.dtype != torch.float32
        ):
            raise ValueError(f"scores_out must be float32 [S, Hq, {max_len}]")
        check_last_dim_contiguous("scores_out", scores_out)
        if subset is not None or window is not None:
            scores_out.fill_(float("-inf"))  # positions not read normalize to 0
        lse = torch.empty((num_seqs, num_q_heads), dtype=torch.float32, device=q.device)

    ws_m: torch.Tensor | None = None
    ws_l: torch.Tensor | None = None
    ws_acc: torch.Tensor | None = None
    if num_splits > 1:
        ws_m, ws_l, ws_acc = split_workspace(num_seqs, num_q_heads, num_splits, block_d, q.device)
    has_subset = subset is not None
    seq_head = (num_kv_heads, num_seqs) if heads_fastest else (num_seqs, num_kv_heads)
    grid = (*seq_head, num_splits)
    _decode_partial_kernel[grid](
        q,
        k_cache,
        v_cache,
        table,
        rows,
        view_lens,
        subset if has_subset else rows,  # dummies keep the signature fixed; never read
        subset_lens if has_subset else rows,
        out,
        ws_m,
        ws_l,
        ws_acc,
        lse,
        scores_out,
        *scale_launch_args(k_scale, v_scale, rows),
        float(scale) * LOG2E,
        int(window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        subset.stride(0) if subset is not None else 0,
        subset.stride(1) if subset is not None else 0,
        *_lens_strides(subset_lens),
        out.stride(0),
        out.stride(1),
        scores_out.stride(0) if scores_out is not None else 0,
        scores_out.stride(1) if scores_out is not None else 0,
        subset.shape[2] if subset is not None else 0,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        HAS_SUBSET=has_subset,
        WRITE_SCORES=write_scores,
        # A quantized cache's elements are converted to q's dtype: the dots run in it.
        DOT_PREC=dot_precision(q.dtype if quantized else k_cache.dtype),
        HEADS_FASTEST=heads_fastest,
        QUANT=quantized,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        assert ws_m is not None and ws_l is not None and ws_acc is not None
        merge_splits(ws_m, ws_l, ws_acc, out, lse)
    if scores_out is not None:
        assert lse is not None
        normalize_scores(scores_out, lse, view_lens)
    return out


def normalize_scores(
    scores_out: torch.Tensor,  # [S, Hq, max_len] float32: base-2 logits, in place
    lse: torch.Tensor,  # [S, Hq] float32: each head's base-2 log-sum-exp
    view_lens: torch.Tensor,  # [S] int32
) -> None:
    """Logits -> probabilities in place, zero past each view (the decode kernels' third
    pass when a method asks for scores)."""
    num_seqs, num_q_heads, max_len = scores_out.shape
    block = 1024
    _scores_normalize_kernel[(num_seqs, num_q_heads, triton.cdiv(max_len, block))](
        scores_out,
        lse,
        view_lens,
        scores_out.stride(0),
        scores_out.stride(1),
        max_len,
        BLOCK=block,
        num_warps=4,
    )


def merge_splits(
    ws_m: torch.Tensor,  # [S, Hq, splits] float32: each split's running max
    ws_l: torch.Tensor,  # [S, Hq, splits] float32: each split's sum of exponentials
    ws_acc: torch.Tensor,  # [S, Hq, splits, BLOCK_D] float32: each split's P @ V
    out: torch.Tensor,  # [S, Hq, D]
    lse: torch.Tensor | None = None,  # [S, Hq] float32: receives the base-2 log-sum-exp
) -> None:
    """Merge split-K partial softmax states into `out` (the decode kernels' second pass)."""
    num_seqs, num_q_heads, num_splits = ws_m.shape
    block_d = ws_acc.shape[-1]
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        ws_m,
        ws_l,
        ws_acc,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=out.shape[-1],
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        BLOCK_SPLITS=next_pow2(num_splits),
        WRITE_SCORES=lse is not None,
        num_warps=4 if block_d * next_pow2(num_splits) >= 4096 else 1,
    )


def _lens_strides(subset_lens: torch.Tensor | None) -> tuple[int, int]:
    """(per sequence, per KV head) strides of the subset counts: `[S]` counts serve
    every head of their sequence."""
    if subset_lens is None:
        return 0, 0
    if subset_lens.dim() == 1:
        return subset_lens.stride(0), 0
    return subset_lens.stride(0), subset_lens.stride(1)
