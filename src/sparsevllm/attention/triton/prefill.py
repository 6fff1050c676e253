"""Varlen causal prefill attention over slot tables (flash-attention style).

Sequence s contributes q_len = q_starts[s+1] - q_starts[s] queries, the LAST q_len
entries of its view: query i sits at view index view_lens[s] - q_len + i and sees view
positions <= that index (the cached prefix plus the chunk itself), read through the
slot table. With a sliding `window` w > 0, query i also ignores view positions at or
before its index - w (HF's rule: it sees itself and the w - 1 entries before it).

Tiling: a program owns BLOCK_M queries of ONE query head and walks BLOCK_N-key tiles with
an fp32 online softmax. Key tiles are processed in two phases: tiles entirely at or
below the block's first query need no mask at all; the diagonal tiles apply the causal
mask; tiles past the block's last query are never visited. Under a window every
visited tile is masked, and tiles wholly before the block's first query's window are
skipped, so a sliding layer costs O(chunk x (chunk + window)), not O(chunk x view).

GQA: one query head per program rather than packing the G heads into the M dimension.
At BLOCK_M = 128 a tile already does ~128 FLOPs per K/V byte (compute bound on an H200),
and the G programs of one KV head are adjacent in launch order (head is the fastest grid
axis), so they run together and share each K/V tile through L2. Packing would save L2
traffic only, at the cost of a (query, head) row mapping and a G-times-smaller query
block.

Quantized caches (int8 / float8_e4m3fn with per-token, per-head scales) are read as in
decode.py: elements converted to the query's dtype, key scales folded into the logit
columns and value scales into the probabilities before P@V. A chunk of more than one
query reads its own keys and values from `k_new` / `v_new` (the forward's K/V as
computed, scale 1) and only the older view entries from the cache, as the torch reference
does; a single query (a decode-like row) reads itself from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    LOG2E,
    check_attention_args,
    check_kv_scales,
    check_new_kv,
    dot_precision,
    next_pow2,
    scale_launch_args,
)


@triton.jit
def _load_scales(ptrs, n_mask, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    """Scales of a key tile [BLOCK_N]; a ragged tile reads 0 past its end (slot 0 pads)."""
    if MASKED:
        sc = tl.load(ptrs, mask=n_mask, other=0.0)
    else:
        sc = tl.load(ptrs)
    return sc


@triton.jit
def prefill_tile_step(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q,
    k_ptrs,
    v_ptrs,
    kv_mask,
    ks_ptrs,
    vs_ptrs,
    n_mask,
    kf_ptrs,
    vf_ptrs,
    fresh,
    m_i,
    l_i,
    acc,
    qk_scale,
    visible,
    DOT_PREC: tl.constexpr,
    MASKED: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One key tile of the online softmax, shared by the dense and the block-sparse
    prefill kernels; `visible` [BLOCK_M, BLOCK_N] only if MASKED.
    With QUANT, `ks_ptrs`/`vs_ptrs` [BLOCK_N] point at the keys' scales (`n_mask`: the
    loadable ones, read only if MASKED), and the keys where `fresh` [BLOCK_N] is set come
    unscaled from `kf_ptrs`/`vf_ptrs` (the chunk's own K/V) instead of the cache."""
    if QUANT:
        own = fresh[:, None]  # [BLOCK_N, 1]
        k = tl.where(
            own,
            tl.load(kf_ptrs, mask=kv_mask & own, other=0.0).to(q.dtype),
            tl.load(k_ptrs, mask=kv_mask & ~own, other=0.0).to(q.dtype),
        )  # [BLOCK_N, BLOCK_D]
    else:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    if QUANT:
        k_sc = tl.where(fresh, 1.0, _load_scales(ks_ptrs, n_mask, MASKED))  # [BLOCK_N]
        qk = qk * (k_sc * qk_scale)[None, :]
    else:
        qk = qk * qk_scale
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if MASKED:
        # A row may have seen no key yet (a tile before its window, or past a padded
        # row's end): keep exp2 away from (-inf) - (-inf) but leave m at -inf, so the
        # first visible key later sets the reference and nothing underflows.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        own = fresh[:, None]
        v = tl.where(
            own,
            tl.load(vf_ptrs, mask=kv_mask & own, other=0.0).to(q.dtype),
            tl.load(v_ptrs, mask=kv_mask & ~own, other=0.0).to(q.dtype),
        )  # [BLOCK_N, BLOCK_D]
        v_sc = tl.where(fresh, 1.0, _load_scales(vs_ptrs, n_mask, MASKED))  # [BLOCK_N]
        pv = (p * v_sc[None, :]).to(q.dtype)  # l_i keeps the unscaled sum
    else:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    rows_ptr,
    q_starts_ptr,
    lens_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kss,
    stride_ksh,
    stride_vss,
    stride_vsh,
    k_new_ptr,
    v_new_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_tr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Program (query head, query block, sequence)."""
    h = tl.program_id(0)
    # Heaviest (last) query blocks first: causal work grows with the block index, and
    # starting the long ones early shortens the tail of the launch.
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(q_starts_ptr + s)
    q_len = tl.load(q_starts_ptr + s + 1) - q_start
    if mb * BLOCK_M < q_len:
        view_len = tl.load(lens_ptr + s)
        row = tl.load(rows_ptr + s).to(tl.int64)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
        offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = view_len - q_len + offs_m  # [BLOCK_M] view index of each query
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        if not QUANT:
            q = q.to(k_cache_ptr.dtype.element_ty)

        first_q = view_len - q_len + mb * BLOCK_M
        last_q = view_len - q_len + tl.minimum((mb + 1) * BLOCK_M, q_len) - 1
        full_end = (first_q + 1) // BLOCK_N * BLOCK_N  # keys [0, full_end) visible to all rows
        hi = last_q + 1  # no row sees a key at or past hi
        lo = first_q * 0  # first key tile visited
        if HAS_WINDOW:
            # Keys before the first query's window are invisible to the whole block.
            lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
            full_end = lo

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table_row = table_ptr + row * stride_tr
        k_base = k_cache_ptr + kvh * stride_kch
        v_base = v_cache_ptr + kvh * stride_vch
        ks_base = k_scale_ptr + kvh * stride_ksh  # a dummy without QUANT, never read
        vs_base = v_scale_ptr + kvh * stride_vsh
        kn_base = k_new_ptr + kvh * stride_knh  # the chunk's own K/V (read only with QUANT)
        vn_base = v_new_ptr + kvh * stride_vnh
        # View positions >= own_start are the chunk's own tokens; a single query has none.
        own_start = tl.where(q_len > 1, view_len - q_len, view_len)
        dm = d_mask[None, :]
        for j in range(lo, full_end, BLOCK_N):
            offs = j + offs_n  # [BLOCK_N] key view positions
            slot = tl.load(table_row + offs).to(tl.int64)  # [BLOCK_N]; < full_end <= L
            new_row = tl.maximum(q_start + offs - own_start, 0).to(tl.int64)
            m_i, l_i, acc = prefill_tile_step(
                q,
                k_base + slot[:, None] * stride_kcs + offs_d[None, :],
                v_base + slot[:, None] * stride_vcs + offs_d[None, :],
                dm,
                ks_base + slot * stride_kss,
                vs_base + slot * stride_vss,
                None,
                kn_base + new_row[:, None] * stride_knt + offs_d[None, :],
                vn_base + new_row[:, None] * stride_vnt + offs_d[None, :],
                offs >= own_start,
                m_i,
                l_i,
                acc,
                qk_scale,
                None,
                DOT_PREC,
                False,
                QUANT,
            )
        for j in range(full_end, hi, BLOCK_N):
            offs = j + offs_n  # [BLOCK_N] key view positions
            k_valid = offs < hi
            slot = tl.load(table_row + offs, mask=k_valid, other=0).to(tl.int64)
            new_row = tl.maximum(q_start + offs - own_start, 0).to(tl.int64)
            # Padded query rows (offs_m >= q_len) have q_pos >= hi: they see every loaded
            # key, stay finite, and are never stored.
            visible = (offs[None, :] <= q_pos[:, None]) & k_valid[None, :]
            if HAS_WINDOW:
                visible = visible & (offs[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = prefill_tile_step(
                q,
                k_base + slot[:, None] * stride_kcs + offs_d[None, :],
                v_base + slot[:, None] * stride_vcs + offs_d[None, :],
                k_valid[:, None] & dm,
                ks_base + slot * stride_kss,
                vs_base + slot * stride_vss,
                k_valid,
                kn_base + new_row[:, None] * stride_knt + offs_d[None, :],
                vn_base + new_row[:, None] * stride_vnt + offs_d[None, :],
                (offs >= own_start) & k_valid,
                m_i,
                l_i,
                acc,
                qk_scale,
                visible,
                DOT_PREC,
                True,
                QUANT,
            )

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dm)


def prefill_config(head_dim: int, max_q_len: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes and launch options, tuned on an H200 (32K causal prompt, bf16).

    D=128: 256x64 tiles, 8 warps, 3 stages gave 427 TFLOP/s (128x128: 384, 128x64: 320);
    short chunks keep 128-row blocks so little of a block is padding. D=64: 128x64,
    8 warps: 375 TFLOP/s. 4-byte caches (tests, debugging) need half the shared memory
    per element and take small tiles, as does the untuned D>128 case. `dtype` is the
    dots' operand dtype: the cache's, or the query's for a quantized cache.
    """
    block_d = next_pow2(max(head_dim, 16))
    if torch.empty((), dtype=dtype).element_size() > 2 or block_d > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if block_d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if max_q_len >= 1024:
        return dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    q_starts: torch.Tensor,  # [S + 1] int32 cumulative query offsets, q_starts[S] = T
    view_lens: torch.Tensor,  # [S] int32
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]
    max_q_len: int,
    *,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
    v_scale: torch.Tensor | None = None,  # [num_slots, Hkv] float32
    k_new: torch.Tensor | None = None,  # [T, Hkv, D] the forward's own K (model dtype)
    v_new: torch.Tensor | None = None,  # [T, Hkv, D]
) -> torch.Tensor:
    """Causal attention of every chunk query over its view; writes and returns `out`.

    `max_q_len` (>= every q_len) sizes the grid on the host, so no device value is read.
    `window` (sliding-window layers): each query sees itself and the window - 1 view
    entries before it. The keyword-only tile options override `prefill_config`.
    `k_scale`/`v_scale` go with (and only with) an int8 or float8_e4m3fn cache: value =
    element * scale of its (slot, KV head), as kv.scaled.dequantize; with them go
    `k_new`/`v_new`, the K/V the chunks' queries read for their own tokens (see above).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = rows.shape[0]
    q = check_attention_args(q, k_cache, v_cache, table, out)
    quantized = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    k_new, v_new = check_new_kv(quantized, k_new, v_new, num_tokens, k_cache)
    # A quantized cache's elements are converted to q's dtype: the dots run in it.
    compute_dtype = q.dtype if quantized else k_cache.dtype
    if q_starts.shape != (num_seqs + 1,) or view_lens.shape != (num_seqs,):
        raise ValueError("q_starts must be [S + 1] and view_lens [S]")
    if num_tokens == 0 or num_seqs == 0 or max_q_len <= 0:
        return out
    cfg = prefill_config(head_dim, max_q_len, compute_dtype)
    for key, value in (
        ("BLOCK_M", block_m),
        ("BLOCK_N", block_n),
        ("num_warps", num_warps),
        ("num_stages", num_stages),
    ):
        if value is not None:
            cfg[key] = value
    grid = (num_q_heads, triton.cdiv(max_q_len, cfg["BLOCK_M"]), num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        table,
        rows,
        q_starts,
        view_lens,
        out,
        *scale_launch_args(k_scale, v_scale, rows),
        k_new,
        v_new,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        float(scale) * LOG2E,
        int(window or 0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_D=next_pow2(max(head_dim, 16)),
        DOT_PREC=dot_precision(compute_dtype),
        HAS_WINDOW=window is not None,
        QUANT=quantized,
        **cfg,
    )
    return out
