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
from triton.tools.tensor_descriptor import TensorDescriptor

from sparsevllm.attention.triton._common import (
    LOG2E,
    check_attention_args,
    check_kv_scales,
    check_new_kv,
    dot_precision,
    next_pow2,
    scale_launch_args,
)
from sparsevllm.attention.triton.prefill_tile import dense_tile, prefill_tile_step


@triton.jit
def _contiguous_tiles(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q,
    k_base,
    v_base,
    k_desc,
    v_desc,
    first_slot,
    kvh,
    lo,
    full_end,
    hi,
    q_pos,
    m_i,
    l_i,
    acc,
    qk_scale,
    window,
    stride_kcs,
    stride_vcs,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    TMA: tl.constexpr,
):
    """The key tiles of a view held in consecutive slots from `first_slot` (a model-dtype
    cache): view position p is slot first_slot + p, so no slot table is read. Fully
    visible tiles load whole [BLOCK_N, D] rows (TMA: one bulk copy each, into shared
    memory, off the warps' load path); the diagonal tiles are masked."""
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = (offs_d < HEAD_DIM)[None, :]  # [1, BLOCK_D]
    for j in range(lo, full_end, BLOCK_N):
        if TMA:
            k = k_desc.load([first_slot + j, kvh * HEAD_DIM])  # [BLOCK_N, D]
            v = v_desc.load([first_slot + j, kvh * HEAD_DIM])
        else:
            slot = (first_slot + j + offs_n).to(tl.int64)  # [BLOCK_N]
            k_ptrs = k_base + slot[:, None] * stride_kcs + offs_d[None, :]
            v_ptrs = v_base + slot[:, None] * stride_vcs + offs_d[None, :]
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_ptrs)  # [BLOCK_N, BLOCK_D]
                v = tl.load(v_ptrs)
            else:
                k = tl.load(k_ptrs, mask=dm, other=0.0)
                v = tl.load(v_ptrs, mask=dm, other=0.0)
        m_i, l_i, acc = dense_tile(q, k, v, m_i, l_i, acc, qk_scale, DOT_PREC)
    for j in range(full_end, hi, BLOCK_N):
        offs = j + offs_n  # [BLOCK_N] key view positions
        k_valid = offs < hi
        slot = (first_slot + offs).to(tl.int64)
        visible = (offs[None, :] <= q_pos[:, None]) & k_valid[None, :]  # [BLOCK_M, BLOCK_N]
        if HAS_WINDOW:
            visible = visible & (offs[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = prefill_tile_step(
            q,
            k_base + slot[:, None] * stride_kcs + offs_d[None, :],
            v_base + slot[:, None] * stride_vcs + offs_d[None, :],
            k_valid[:, None] & dm,
            None, None, k_valid, None, None, None,
            m_i, l_i, acc, qk_scale, visible, DOT_PREC, True, False,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _table_tiles(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q,
    table_row,
    k_base,
    v_base,
    ks_base,
    vs_base,
    kn_base,
    vn_base,
    q_start,
    own_start,
    lo,
    full_end,
    hi,
    q_pos,
    m_i,
    l_i,
    acc,
    qk_scale,
    window,
    stride_kcs,
    stride_vcs,
    stride_kss,
    stride_vss,
    stride_knt,
    stride_vnt,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANT: tl.constexpr,
):
    """The key tiles of any view, each tile's slots read from the slot table row."""
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = (offs_d < HEAD_DIM)[None, :]  # [1, BLOCK_D]
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
    return m_i, l_i, acc


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
    contig_ptr,
    k_desc,
    v_desc,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANT: tl.constexpr,
    RUNS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Program (query head, query block, sequence). `contig_ptr` [S] holds each view's
    first slot when the view is one run of consecutive slots, else -1. RUNS = 0: every
    view through the slot table (contig_ptr unread); 1: only the one-run views, each
    addressed as first slot + position with no table reads (with TMA, its fully visible
    tiles come through the descriptors `k_desc`/`v_desc` over the caches as
    [num_slots, Hkv * D]); 2: only the other views, through the table. A launch pair
    (1, 2) covers every view, each half compiled without the other's path."""
    h = tl.program_id(0)
    # Heaviest (last) query blocks first: causal work grows with the block index, and
    # starting the long ones early shortens the tail of the launch.
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(q_starts_ptr + s)
    q_len = tl.load(q_starts_ptr + s + 1) - q_start
    first_slot = 0
    mine = mb * BLOCK_M < q_len
    if RUNS == 1:
        first_slot = tl.load(contig_ptr + s)
        mine = mine & (first_slot >= 0)
    if RUNS == 2:
        mine = mine & (tl.load(contig_ptr + s) < 0)
    if mine:
        view_len = tl.load(lens_ptr + s)
        row = tl.load(rows_ptr + s).to(tl.int64)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the chunk
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
        if RUNS == 1:
            m_i, l_i, acc = _contiguous_tiles(
                q, k_base, v_base, k_desc, v_desc, first_slot, kvh, lo, full_end, hi, q_pos,
                m_i, l_i, acc, qk_scale, window, stride_kcs, stride_vcs, HEAD_DIM, BLOCK_N,
                BLOCK_D, DOT_PREC, HAS_WINDOW, TMA,
            )  # fmt: skip
        else:
            m_i, l_i, acc = _table_tiles(
                q, table_row, k_base, v_base, ks_base, vs_base, kn_base, vn_base, q_start,
                own_start, lo, full_end, hi, q_pos, m_i, l_i, acc, qk_scale, window,
                stride_kcs, stride_vcs, stride_kss, stride_vss, stride_knt, stride_vnt,
                HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PREC, HAS_WINDOW, QUANT,
            )  # fmt: skip
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dm)


def prefill_config(
    head_dim: int, max_q_len: int, dtype: torch.dtype, one_run: bool = False
) -> dict[str, int]:
    """Tile sizes and launch options, tuned on an H200 (32K causal prompt, bf16).

    D=128 through the slot table: 256x64 tiles, 8 warps, 3 stages gave 405 TFLOP/s
    (128x128: 366); views in one run of slots (`one_run`, TMA tiles): 128x128 gave 540
    (256x64: 502; docs/benchmarks/h200/prefill_kernels.json). Short chunks keep 128-row
    blocks so little of a block is padding. D=64: 128x64, 8 warps: 375 TFLOP/s. 4-byte
    caches (tests, debugging) need half the shared memory per element and take small
    tiles, as does the untuned D>128 case. `dtype` is the dots' operand dtype: the
    cache's, or the query's for a quantized cache.
    """
    block_d = next_pow2(max(head_dim, 16))
    if torch.empty((), dtype=dtype).element_size() > 2 or block_d > 128:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    if block_d <= 64:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    if max_q_len >= 1024 and not one_run:
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
    contig_starts: torch.Tensor | None = None,  # [S] int32 first slot of a one-run view, or -1
) -> torch.Tensor:
    """Causal attention of every chunk query over its view; writes and returns `out`.

    `max_q_len` (>= every q_len) sizes the grid on the host, so no device value is read.
    `window` (sliding-window layers): each query sees itself and the window - 1 view
    entries before it. The keyword-only tile options override `prefill_config`.
    `k_scale`/`v_scale` go with (and only with) an int8 or float8_e4m3fn cache: value =
    element * scale of its (slot, KV head), as kv.scaled.dequantize; with them go
    `k_new`/`v_new`, the K/V the chunks' queries read for their own tokens (see above).
    `contig_starts` (`ForwardBatch.contiguous_starts`) lets views held in consecutive
    slots skip the slot table (model-dtype caches; ignored for quantized ones): two
    launches then split the sequences, one-run views and the others, each launch built
    for its own path and tiles (programs of the other half return at once).
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
    overrides = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    args = [
        q, k_cache, v_cache, table, rows, q_starts, view_lens, out,
        *scale_launch_args(k_scale, v_scale, rows),
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        float(scale) * LOG2E, int(window or 0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
    ]  # fmt: skip
    consts = dict(
        HEAD_DIM=head_dim,
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_D=next_pow2(max(head_dim, 16)),
        DOT_PREC=dot_precision(compute_dtype),
        HAS_WINDOW=window is not None,
        QUANT=quantized,
    )
    modes = (1, 2) if contig_starts is not None and not quantized else (0,)
    for mode in modes:
        cfg = prefill_config(head_dim, max_q_len, compute_dtype, one_run=mode == 1)
        cfg.update({key: value for key, value in overrides.items() if value is not None})
        descs = _tma_descriptors(k_cache, v_cache, cfg["BLOCK_N"]) if mode == 1 else None
        grid = (num_q_heads, triton.cdiv(max_q_len, cfg["BLOCK_M"]), num_seqs)
        _prefill_kernel[grid](
            *args,
            rows if contig_starts is None else contig_starts,
            *(descs or (k_cache, v_cache)),
            RUNS=mode,
            TMA=descs is not None,
            **consts,
            **cfg,
        )
    return out


def _tma_descriptors(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int
) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Bulk-copy (TMA) descriptors over the caches as [num_slots, Hkv * D] with
    [block_n, D] boxes, where the hardware and the layout allow them: a Hopper or newer
    GPU, 16-bit elements, contiguous caches and a power-of-two head_dim."""
    head_dim = k_cache.shape[-1]
    if (
        not k_cache.is_cuda
        or torch.cuda.get_device_capability(k_cache.device)[0] < 9
        or k_cache.element_size() != 2
        or head_dim != next_pow2(head_dim)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        return None
    flat = [c.view(c.shape[0], -1) for c in (k_cache, v_cache)]  # [num_slots, Hkv * D]
    k_desc, v_desc = (TensorDescriptor.from_tensor(c, [block_n, head_dim]) for c in flat)
    return k_desc, v_desc
