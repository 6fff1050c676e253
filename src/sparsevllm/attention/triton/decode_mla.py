"""Decode attention over MLA's latent rows (kv/latent.py), absorbed query, split-K.

Multi-head latent attention in the absorbed form (layers/mla.py) is one-KV-head
attention: every query head `[c_q (R) | q_pe (P)]` scores the same latent row
`[c_kv (R) | k_pe (P)]` of each token, and the value is the row's first R columns. So:

* Heads packed into M: a program serves BLOCK_H query heads of one sequence; each key
  tile `[BLOCK_N, R + P]` is loaded once, scored for all BLOCK_H heads as one
  `[BLOCK_H, BLOCK_N]` dot and then reused as the value tile (its R part): the latent row
  is read once per token and head block, not once per head (GQA's decode kernel would
  re-read it for each of the H "KV heads" if the row were expanded).
* R + P = 576 is not a power of two: the key dot is split into the R part (512) and the
  P part (64) loaded separately, which also gives V = the R part without a second load.
  Both parts are padded to powers of two >= 16 (tensor-core K), masked.
* Split-K (flash-decoding): each sequence's (effective) view is cut into `num_splits`
  parts whose partial (max, sum, acc) states go to an fp32 workspace in decode.py's
  layout `[S, H, splits(, BLOCK_R)]`, merged by decode.py's `merge_splits`.
* Quantized rows (int8 / float8_e4m3fn, one float32 scale per row, kv/latent.py): the
  elements are converted to the query's dtype in registers and the row's scale folds
  into the logit column (K) and the probability column (V = the same row, same scale).
* Method hooks as decode.py's: `subset`/`subset_lens` (the single KV head's selected
  positions plus the query's own token) and `scores_out` (per-head probabilities over
  view positions, normalised by decode.py's elementwise kernel).

No sliding window: MLA models have none. CUDA-graph capturable: no host sync, and every
buffer is sized from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    LOG2E,
    auto_num_splits,
    check_last_dim_contiguous,
    dot_precision,
    next_pow2,
    num_sms,
    split_workspace,
)
from sparsevllm.attention.triton.decode import merge_splits, normalize_scores
from sparsevllm.kv.scaled import QMAX

# Each program holds a [BLOCK_H, BLOCK_R] fp32 accumulator (32 x 512: 64 KiB of
# registers), ~8x a GQA decode program's, so fewer programs fill an SM; and the merge
# holds [splits, BLOCK_R] per head. Split so that about this many programs run per SM, at
# most MAX_MLA_SPLITS (to be tuned on the H200: scripts/mla_decode_check.py).
MLA_PROGRAMS_PER_SM = 4
MAX_MLA_SPLITS = 32


@triton.jit
def _effective_view(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    subset_lens_ptr, s, stride_sls, view_len, subset_cap, HAS_SUBSET: tl.constexpr
):
    """(count of subset entries read before the own token, whether the whole view is
    read, its effective length), as decode.py's kernel defines them."""
    if HAS_SUBSET:
        sub_len = tl.load(subset_lens_ptr + s * stride_sls)
        whole = sub_len < 0
        n_sel = tl.where(whole, view_len - 1, tl.minimum(sub_len, subset_cap))
        eff_len = tl.where(view_len > 0, n_sel + 1, 0)
    else:
        whole = view_len >= 0
        n_sel = view_len - 1
        eff_len = view_len
    return n_sel, whole, eff_len


@triton.jit
def _tile_positions(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    subset_row, offs, valid, n_sel, whole, view_len, HAS_SUBSET: tl.constexpr
):
    """View positions `[BLOCK_N]` of effective-sequence indices `offs`: subset[0:n_sel]
    then the own token (view_len - 1); the identity without a subset or when whole."""
    if HAS_SUBSET:
        pos = tl.load(subset_row + offs, mask=valid & (offs < n_sel) & (~whole), other=0)
        pos = tl.where(whole, offs, pos)
        pos = tl.where(offs == n_sel, view_len - 1, pos)
    else:
        pos = offs
    return pos


@triton.jit
def _mla_partial_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    kv_ptr,
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
    kv_scale_ptr,
    stride_scale,
    qk_scale,
    num_heads,
    stride_qs,
    stride_qh,
    stride_kvs,
    stride_tr,
    stride_ss,
    stride_sls,
    stride_os,
    stride_oh,
    stride_scs,
    stride_sch,
    subset_cap,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SUBSET: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Program (head block, sequence, split): online softmax over one split."""
    hb = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + s).to(tl.int64)
    view_len = tl.load(lens_ptr + s)
    n_sel, whole, eff_len = _effective_view(
        subset_lens_ptr, s, stride_sls, view_len, subset_cap, HAS_SUBSET
    )
    # Split bounds rounded to whole tiles so only each split's last tile is ragged.
    chunk = tl.cdiv(tl.cdiv(eff_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, eff_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_mask = heads < num_heads
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_r = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
    r_mask = offs_r < RANK
    p_mask = offs_p < ROPE
    q_row = q_ptr + s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh
    # Padded heads and channels are 0: finite logits, never stored.
    q_r = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_p = tl.load(
        q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0
    )  # [BLOCK_H, BLOCK_R], [BLOCK_H, BLOCK_P]
    if not QUANT:
        q_r = q_r.to(kv_ptr.dtype.element_ty)
        q_p = q_p.to(kv_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table_row = table_ptr + row * stride_tr
    subset_row = subset_ptr + s.to(tl.int64) * stride_ss  # a dummy without a subset
    # Every tile of [start, end) holds >= 1 valid key, so m_i is finite after the first.
    for j in range(start, end, BLOCK_N):
        offs = j + offs_n  # [BLOCK_N] indices into the effective sequence
        valid = offs < end
        pos = _tile_positions(subset_row, offs, valid, n_sel, whole, view_len, HAS_SUBSET)
        slot = tl.load(table_row + pos, mask=valid, other=0).to(tl.int64)  # [BLOCK_N]
        kv_row = kv_ptr + slot[:, None] * stride_kvs
        c = tl.load(kv_row + offs_r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
        pe = tl.load(
            kv_row + RANK + offs_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R] (the key's c_kv and the value), [BLOCK_N, BLOCK_P]
        if QUANT:
            c = c.to(q_r.dtype)
            pe = pe.to(q_r.dtype)
        qk = tl.dot(q_r, tl.trans(c), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
        qk = tl.dot(q_p, tl.trans(pe), acc=qk, input_precision=DOT_PREC)
        if QUANT:
            # Row n's scale scales logit column n. Masked: slot 0 pads invalid positions.
            row_sc = tl.load(kv_scale_ptr + slot * stride_scale, mask=valid, other=0.0)
            qk = qk * (row_sc * qk_scale)[None, :]
        else:
            qk = qk * qk_scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        if WRITE_SCORES:
            sc = scores_ptr + s.to(tl.int64) * stride_scs + heads[:, None] * stride_sch
            tl.store(sc + pos[None, :], qk, mask=h_mask[:, None] & valid[None, :])
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            # The value is the same row: its scale scales probability column n.
            pv = (p * row_sc[None, :]).to(c.dtype)
        else:
            pv = p.to(c.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, c, input_precision=DOT_PREC)
        m_i = m_new
    _write_partial(
        out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, lse_ptr, m_i, l_i, acc, s, split, heads,
        h_mask, r_mask, num_heads, stride_os, stride_oh, BLOCK_R, NUM_SPLITS, WRITE_SCORES,
    )  # fmt: skip


@triton.jit
def _write_partial(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    out_ptr,
    ws_m_ptr,
    ws_l_ptr,
    ws_acc_ptr,
    lse_ptr,
    m_i,
    l_i,
    acc,
    s,
    split,
    heads,
    h_mask,
    r_mask,
    num_heads,
    stride_os,
    stride_oh,
    BLOCK_R: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
):
    """One split: the normalised output (and base-2 log-sum-exp); several: the partial
    state in decode.py's workspace layout, an empty split storing (-inf, 0, 0)."""
    offs_r = tl.arange(0, BLOCK_R)
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # empty view (padding row): output zeros
        o = acc / l_safe[:, None]
        o_ptr = out_ptr + s.to(tl.int64) * stride_os + heads[:, None] * stride_oh
        o_mask = h_mask[:, None] & r_mask[None, :]
        tl.store(o_ptr + offs_r[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_SCORES:
            tl.store(lse_ptr + s * num_heads + heads, m_i + tl.log2(l_safe), mask=h_mask)
    else:
        base = ((s * num_heads + heads) * NUM_SPLITS + split).to(tl.int64)  # [BLOCK_H]
        tl.store(ws_m_ptr + base, m_i, mask=h_mask)
        tl.store(ws_l_ptr + base, l_i, mask=h_mask)
        tl.store(ws_acc_ptr + base[:, None] * BLOCK_R + offs_r[None, :], acc, mask=h_mask[:, None])


def mla_decode_config(
    num_seqs: int, num_heads: int, eff_max: int, device: torch.device, row_bytes: int
) -> tuple[int, int, int]:
    """Default (block_h, block_n, num_splits) from shapes only (graph-safe); `row_bytes`
    is the cache's element size."""
    # 16 heads is the smallest tensor-core M; up to 32 share one key tile (GLM-4.7-Flash's
    # 20 heads: one block; DeepSeek-V3's 128: four, neighbouring programs that read the
    # same rows, mostly from L2). 64 would hold a [64, 512] fp32 accumulator: spills.
    block_h = max(16, min(next_pow2(num_heads), 32))
    # H200 sweep (scripts/mla_decode_check.py --sweep, GLM-4.7-Flash at 64 x 8K and
    # 8 x 32K, bf16): 64-row tiles, 4 warps, 2 stages were fastest (0.28 ms at 64 x 8K,
    # against 0.30 with 32 rows and 0.55 with 8 warps). 1-byte rows are converted in
    # registers, so they keep 32 rows.
    block_n = 64 if row_bytes >= 2 else 32
    head_blocks = triton.cdiv(num_heads, block_h)
    splits = auto_num_splits(num_seqs, head_blocks, eff_max, device)
    want = -(-MLA_PROGRAMS_PER_SM * num_sms(device) // max(1, num_seqs * head_blocks))
    return block_h, block_n, max(1, min(splits, want, MAX_MLA_SPLITS))


def decode_mla_attention(
    q: torch.Tensor,  # [S, H, R + P] absorbed queries
    kv_cache: torch.Tensor,  # [num_slots, 1, R + P] latent rows [c_kv | k_pe]
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32 table row of each sequence
    view_lens: torch.Tensor,  # [S] int32 view length (incl. the query's own token)
    scale: float,
    out: torch.Tensor,  # [S, H, R]
    *,
    subset: torch.Tensor | None = None,  # [S, 1, B] int32 ascending view positions
    subset_lens: torch.Tensor | None = None,  # [S] or [S, 1] int32 valid entries
    scores_out: torch.Tensor | None = None,  # [S, H, max_len] float32
    kv_scale: torch.Tensor | None = None,  # [num_slots, 1] float32 (int8 / fp8 rows)
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of each sequence's single absorbed query over its latent view; the
    value is each row's first R = `out.shape[-1]` entries. Writes and returns `out`.

    `subset`, `subset_lens` and `scores_out` mean what they mean for decode.py's
    `decode_attention` with one KV head. `kv_scale` goes with (and only with) an int8 or
    float8_e4m3fn cache: value = element * scale of its row, as kv.scaled.dequantize.
    `num_splits`, `block_h`, `block_n`, `num_warps`, `num_stages` override the defaults
    (`mla_decode_config`).
    """
    num_seqs, num_heads, width = q.shape
    rank = out.shape[-1]
    q = _check_args(q, kv_cache, table, out, kv_scale)
    quantized = kv_scale is not None
    eff_max = _check_subset(subset, subset_lens, num_seqs, table.shape[1])
    if num_seqs == 0:
        return out
    d_block_h, d_block_n, d_splits = mla_decode_config(
        num_seqs, num_heads, eff_max, q.device, kv_cache.element_size()
    )
    block_h = block_h or d_block_h
    splits = max(1, int(num_splits or d_splits))
    block_r = next_pow2(max(rank, 16))
    lse = _scores_lse(scores_out, subset, num_seqs, num_heads, table.shape[1], q.device)
    ws = _workspace(num_seqs, num_heads, splits, block_r, q.device)
    grid = (triton.cdiv(num_heads, block_h), num_seqs, splits)
    dummy = rows  # keeps the signature fixed where an optional tensor is absent; never read
    _mla_partial_kernel[grid](
        q, kv_cache, table, rows, view_lens,
        subset if subset is not None else dummy,
        subset_lens if subset_lens is not None else dummy,
        out, *(ws or (None, None, None)), lse, scores_out,
        kv_scale if kv_scale is not None else dummy,
        kv_scale.stride(0) if kv_scale is not None else 0,
        float(scale) * LOG2E, num_heads,
        q.stride(0), q.stride(1), kv_cache.stride(0), table.stride(0),
        subset.stride(0) if subset is not None else 0,
        subset_lens.stride(0) if subset_lens is not None else 0,
        out.stride(0), out.stride(1),
        scores_out.stride(0) if scores_out is not None else 0,
        scores_out.stride(1) if scores_out is not None else 0,
        subset.shape[2] if subset is not None else 0,
        RANK=rank, ROPE=width - rank, BLOCK_H=block_h, BLOCK_N=block_n or d_block_n,
        BLOCK_R=block_r, BLOCK_P=next_pow2(max(width - rank, 16)), NUM_SPLITS=splits,
        HAS_SUBSET=subset is not None, WRITE_SCORES=scores_out is not None,
        # Quantized rows are converted to q's dtype: the dots run in it.
        DOT_PREC=dot_precision(q.dtype if quantized else kv_cache.dtype), QUANT=quantized,
        num_warps=num_warps or 4, num_stages=num_stages,
    )  # fmt: skip
    if ws is not None:
        merge_splits(*ws, out, lse)
    if scores_out is not None:
        assert lse is not None
        normalize_scores(scores_out, lse, view_lens)
    return out


def _check_args(
    q: torch.Tensor,  # [S, H, R + P]
    kv_cache: torch.Tensor,  # [num_slots, 1, R + P]
    table: torch.Tensor,  # [num_rows, max_len]
    out: torch.Tensor,  # [S, H, R]
    kv_scale: torch.Tensor | None,  # [num_slots, 1]
) -> torch.Tensor:
    """Validate shapes, strides and the scale; returns a unit-stride q."""
    if (
        kv_cache.shape[1] != 1
        or kv_cache.shape[2] != q.shape[2]
        or out.shape[:2] != q.shape[:2]
        or not 0 < out.shape[2] < q.shape[2]
    ):
        raise ValueError(
            f"bad shapes: q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"out {tuple(out.shape)} (want [S, H, R + P], [slots, 1, R + P], [S, H, R])"
        )
    if table.stride(1) != 1:
        raise ValueError("table rows must be contiguous")
    for name, t in (("kv_cache", kv_cache), ("out", out)):
        check_last_dim_contiguous(name, t)
    quantized = kv_cache.dtype in QMAX
    if quantized != (kv_scale is not None):
        raise ValueError(
            f"kv_scale goes with (and only with) an int8 or fp8 cache, got {kv_cache.dtype}"
        )
    if kv_scale is not None and (
        kv_scale.dtype != torch.float32 or tuple(kv_scale.shape) != tuple(kv_cache.shape[:2])
    ):
        raise ValueError(f"kv_scale must be float32 {list(kv_cache.shape[:2])}")
    return q if q.stride(-1) == 1 else q.contiguous()


def _check_subset(
    subset: torch.Tensor | None,
    subset_lens: torch.Tensor | None,
    num_seqs: int,
    max_len: int,
) -> int:
    """Validate a subset; returns the longest effective sequence (for the split count)."""
    if (subset is None) != (subset_lens is None):
        raise ValueError("subset and subset_lens go together")
    if subset is None or subset_lens is None:
        return max_len
    if subset.shape[:2] != (num_seqs, 1) or subset.stride(2) != 1:
        raise ValueError(f"subset must be [S, 1, B] with contiguous B, got {tuple(subset.shape)}")
    if subset_lens.shape not in ((num_seqs,), (num_seqs, 1)):
        raise ValueError(f"subset_lens must be [S] or [S, 1], got {tuple(subset_lens.shape)}")
    return subset.shape[2] + 1


def _scores_lse(
    scores_out: torch.Tensor | None,
    subset: torch.Tensor | None,
    num_seqs: int,
    num_heads: int,
    max_len: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Validate `scores_out` (and pre-fill it under a subset, so that positions not read
    normalise to 0); returns the `[S, H]` log-sum-exp buffer it needs."""
    if scores_out is None:
        return None
    if scores_out.shape != (num_seqs, num_heads, max_len) or scores_out.dtype != torch.float32:
        raise ValueError(f"scores_out must be float32 [S, H, {max_len}]")
    check_last_dim_contiguous("scores_out", scores_out)
    if subset is not None:
        scores_out.fill_(float("-inf"))
    return torch.empty((num_seqs, num_heads), dtype=torch.float32, device=device)


def _workspace(
    num_seqs: int, num_heads: int, splits: int, block_r: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """decode.py's split-K workspace: (max, sum) `[S, H, splits]`, acc `[S, H, splits,
    BLOCK_R]`, float32; None for one split (the kernel writes the output)."""
    if splits == 1:
        return None
    return split_workspace(num_seqs, num_heads, splits, block_r, device)
