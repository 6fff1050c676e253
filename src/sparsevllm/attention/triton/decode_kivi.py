"""Decode attention over KIVI storage (kv/kivi.py): packed 4- or 2-bit codes dequantized
in registers, the residual window read in full precision.

The same split-K, GQA-packed scheme as decode.py (one program per KV head x sequence x
split of the view; decode.py's merge kernel combines the splits). Codes are planar
(kv/kivi_codes.py): a row of D channels is NPL = 8 / bits planes of P = D * bits / 8
consecutive channels, plane b in bits b * bits of the row's P bytes. A tile loads its
rows' P bytes at once (wide, contiguous loads) and works plane by plane: plane b of the
keys meets the query's channels b*P .. b*P+P-1, plane b of the values makes the output's.

Two kernels, each one loop without branches (so Triton pipelines its loads):

* this module's, over the view's leading tiles whose every entry is sealed in one key
  group (a view sealed in order, G tokens to a group, with BLOCK_N = G; a first small
  kernel finds, per sequence, where that run of tiles ends), split NUM_SPLITS ways.
  Keys are dequantized in registers with the group's per-channel parameters and dotted
  with the query as loaded (`dequant_keys`; or the scale folds into the query,
  `q . (c * s + z) = (q * s) . c + q . z`); values fold their per-token scale into the
  probabilities and their zero points into one per-row sum. Codes come out of their
  bytes as `bias + code` (bf16 128 + c, fp16 1024 + c) without int-to-float conversion;
  in the value dots the bias's excess is subtracted once per row;
* decode_kivi_rest.py's, over the rest (residual rows, tiles spanning groups,
  re-grouped entries): each entry dequantized with its own group's parameters or read
  in full precision. Its per-entry loads need far more registers; in one kernel they
  capped the occupancy of the first loop too.

Both write their softmax states to one split workspace (NUM_SPLITS + 1 parts), which
decode.py's merge kernel combines. The query heads of a KV head are padded to a power
of two (not to 16: `tl.dot` takes fewer rows, and the padding costs registers and
instructions in every elementwise step of the tile).

The plane helpers (unpacking, folding, per-entry dequantization) are in kivi_planes.py.

CUDA-graph capturable: no host sync, buffers sized from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    LOG2E,
    auto_num_splits,
    dot_precision,
    next_pow2,
    split_workspace,
)
from sparsevllm.attention.triton.decode import merge_splits
from sparsevllm.attention.triton.decode_kivi_rest import kivi_rest_kernel
from sparsevllm.attention.triton.kivi_planes import (
    biased_plane,
    code_bias,
    halves,
    query_planes,
    sealed_plane_qk,
    softmax_step,
    store_partial,
)


@triton.jit
def _tile_loads(  # type: ignore[no-untyped-def]
    k_head, v_head, par_head, group_head, slot, ok, gid,
    stride_cs, stride_ps, stride_gg, P: tl.constexpr, NPL: tl.constexpr,
):  # fmt: skip
    """A one-group tile's packed key and value rows `[BLOCK_N, P]`, value parameters
    `[BLOCK_N]` and its group's key parameters, plane by plane `[P]` (int32 pairs)."""
    kb = tl.load(k_head + slot[:, None] * stride_cs, mask=ok[:, None], other=0)
    vb = tl.load(v_head + slot[:, None] * stride_cs, mask=ok[:, None], other=0)
    vw = tl.load(par_head + slot * stride_ps, mask=ok, other=0)
    gp = group_head + gid * stride_gg + tl.arange(0, P)
    g0 = tl.load(gp)
    g1 = tl.load(gp + P)
    if NPL == 4:
        g2 = tl.load(gp + 2 * P)
        g3 = tl.load(gp + 3 * P)
    else:
        g2 = g0
        g3 = g0
    return kb, vb, vw, g0, g1, g2, g3


@triton.jit
def _sealed_tile(  # type: ignore[no-untyped-def]
    kb, vb, vw, g0, g1, g2, g3, ok, q0, q1, q2, q3, qk_scale,
    m_i, l_i, zacc, acc0, acc1, acc2, acc3,
    P: tl.constexpr, BITS: tl.constexpr, NPL: tl.constexpr, qd: tl.constexpr,
    DOT_PREC: tl.constexpr, ASM: tl.constexpr, KDEQ: tl.constexpr,
):  # fmt: skip
    """One tile sealed in one key group folded into the online softmax: keys dequantized
    with the group's parameters (or the group's scale folded into the query), values'
    scales folded into the probabilities and their zero points into `zacc`."""
    qk = sealed_plane_qk(kb, g0, q0, 0, P, BITS, qd, DOT_PREC, ASM, KDEQ)  # [BLOCK_G, BLOCK_N]
    qk += sealed_plane_qk(kb, g1, q1, 1, P, BITS, qd, DOT_PREC, ASM, KDEQ)
    if NPL == 4:
        qk += sealed_plane_qk(kb, g2, q2, 2, P, BITS, qd, DOT_PREC, ASM, KDEQ)
        qk += sealed_plane_qk(kb, g3, q3, 3, P, BITS, qd, DOT_PREC, ASM, KDEQ)
    qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))
    p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i)
    v_s, v_z = halves(vw)
    p_s = (p * v_s[None, :]).to(qd)
    acc0 = acc0 * alpha[:, None] + tl.dot(
        p_s, biased_plane(vb, 0, BITS, qd, ASM), input_precision=DOT_PREC
    )
    acc1 = acc1 * alpha[:, None] + tl.dot(
        p_s, biased_plane(vb, 1, BITS, qd, ASM), input_precision=DOT_PREC
    )
    if NPL == 4:
        acc2 = acc2 * alpha[:, None] + tl.dot(
            p_s, biased_plane(vb, 2, BITS, qd, ASM), input_precision=DOT_PREC
        )
        acc3 = acc3 * alpha[:, None] + tl.dot(
            p_s, biased_plane(vb, 3, BITS, qd, ASM), input_precision=DOT_PREC
        )
    bias_excess = code_bias(qd) * tl.sum(p_s.to(tl.float32), 1)
    zacc = zacc * alpha + tl.sum(p * v_z[None, :], 1) - bias_excess
    return m_i, l_i, zacc, acc0, acc1, acc2, acc3


@triton.jit
def _kivi_tile_plan_kernel(  # type: ignore[no-untyped-def]
    state_ptr,
    table_ptr,
    rows_ptr,
    lens_ptr,
    fast_ptr,
    tile_group_ptr,
    stride_tr,
    stride_tg,
    BLOCK_N: tl.constexpr,
):
    """Program (s, tile): the tile's key group into `tile_group[s, tile]`, and `fast[s]`
    (the view's length on entry) lowered to the tile's start unless every entry of the
    tile is sealed in that one group."""
    s = tl.program_id(0)
    t = tl.program_id(1)
    j = t * BLOCK_N
    view_len = tl.load(lens_ptr + s)
    if j < view_len:
        offs = j + tl.arange(0, BLOCK_N)
        valid = offs < view_len
        row = tl.load(rows_ptr + s).to(tl.int64)
        slot = tl.load(table_ptr + row * stride_tr + offs, mask=valid, other=0)
        st = tl.load(state_ptr + slot, mask=valid, other=0)
        lo = tl.min(tl.where(valid, st, 2**30), 0)
        hi = tl.max(tl.where(valid, st, -1), 0)
        tl.store(tile_group_ptr + s.to(tl.int64) * stride_tg + t, hi)
        tl.atomic_min(fast_ptr + s, j, mask=(lo != hi) | (lo < 0))


@triton.jit
def _kivi_decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    q_ptr, k_codes_ptr, v_codes_ptr, v_par_ptr, groups_ptr, table_ptr, rows_ptr, fast_ptr,
    tile_group_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, qk_scale,
    stride_qs, stride_qh,
    stride_cs, stride_ch,  # codes [num_slots, Hkv, P] (K and V alike)
    stride_ps, stride_ph,  # value parameters [num_slots, Hkv] int32 (scale, zero as two float16)
    stride_gg, stride_gh,  # key groups [num_groups, Hkv, D] int32 (scale, zero as two float16)
    stride_tr, stride_tg,
    HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    ASM: tl.constexpr, KDEQ: tl.constexpr,
):  # fmt: skip
    """Program (KV head, s, split): online softmax over one split of the view's leading
    one-group tiles (`fast[s]` entries), stored as part `split` of `NUM_SPLITS + 1` in
    the split workspace (the last part is decode_kivi_rest.py's)."""
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(0) * GROUP
    P: tl.constexpr = HEAD_DIM * BITS // 8  # channels of a plane, bytes of a packed row
    NPL: tl.constexpr = 8 // BITS  # planes: 2 (int4) or 4 (int2)

    row = tl.load(rows_ptr + s).to(tl.int64)
    fast_len = tl.load(fast_ptr + s)
    chunk = tl.cdiv(tl.cdiv(fast_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, fast_len)

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
    zacc = tl.zeros([BLOCK_G], tl.float32)  # sum of p * value zero points
    acc0 = tl.zeros([BLOCK_G, P], tl.float32)  # output channels 0 .. P-1, and so on
    acc1 = tl.zeros([BLOCK_G, P], tl.float32)
    acc2 = tl.zeros([BLOCK_G, P], tl.float32)
    acc3 = tl.zeros([BLOCK_G, P], tl.float32)
    table_row = table_ptr + row * stride_tr
    k_head = k_codes_ptr + kvh * stride_ch + offs_p[None, :]
    v_head = v_codes_ptr + kvh * stride_ch + offs_p[None, :]
    par_head = v_par_ptr + kvh * stride_ph
    group_head = groups_ptr + kvh * stride_gh
    tg_row = tile_group_ptr + s.to(tl.int64) * stride_tg
    for j in range(start, end, BLOCK_N):
        ok = (j + offs_n) < end
        slot = tl.load(table_row + j + offs_n, mask=ok, other=0).to(tl.int64)
        gid = tl.load(tg_row + j // BLOCK_N).to(tl.int64)
        kb, vb, vw, g0, g1, g2, g3 = _tile_loads(
            k_head, v_head, par_head, group_head, slot, ok, gid,
            stride_cs, stride_ps, stride_gg, P, NPL,
        )  # fmt: skip
        m_i, l_i, zacc, acc0, acc1, acc2, acc3 = _sealed_tile(
            kb, vb, vw, g0, g1, g2, g3, ok, q0, q1, q2, q3, qk_scale,
            m_i, l_i, zacc, acc0, acc1, acc2, acc3, P, BITS, NPL, qd, DOT_PREC, ASM, KDEQ,
        )  # fmt: skip
    base = ((s * num_q_heads + heads) * (NUM_SPLITS + 1) + split).to(tl.int64)
    store_partial(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, base, g_mask, m_i, l_i, zacc,
        acc0, acc1, acc2, acc3, HEAD_DIM, P, NPL,
    )  # fmt: skip


def _as_pairs(name: str, t: torch.Tensor) -> torch.Tensor:
    """float16 `[..., 2]` (scale, zero point) -> int32 `[...]`: one load per pair."""
    if t.dtype != torch.float16 or t.shape[-1] != 2 or t.stride(-1) != 1 or t.stride(-2) != 2:
        raise ValueError(
            f"{name} must be float16 [..., 2] with packed pairs, got {t.dtype} {t.shape}"
        )
    return t.view(torch.int32).squeeze(-1)


def kivi_tile_plan(
    state: torch.Tensor,  # [num_slots] int32 (kv/kivi.py)
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the view's leading entries whose tiles of `block_n` are each sealed
    in one key group (`[S]` int32, a multiple of `block_n` or the whole view), and each
    tile's group (`[S, tiles]` int32, meaningful for those tiles)."""
    fast = view_lens.to(torch.int32).clone()
    tiles = triton.cdiv(table.shape[1], block_n)
    tile_group = torch.empty((fast.numel(), tiles), dtype=torch.int32, device=fast.device)
    if fast.numel():
        _kivi_tile_plan_kernel[(fast.numel(), tiles)](
            state, table, rows, view_lens, fast, tile_group, table.stride(0),
            tile_group.stride(0), BLOCK_N=block_n, num_warps=1,
        )  # fmt: skip
    return fast, tile_group


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
    # The fastest of 2/4/8 warps x 1-4 stages at 64 x 8K on the H200 (kivi_kernels).
    num_warps: int = 2,
    num_stages: int = 3,
    asm_unpack: bool = True,
    dequant_keys: bool = True,
    block_g: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single query over its whole view in KIVI storage;
    writes and returns `out` (equal to the torch reference over `KiviStorage.read`).
    `block_n` should be the key group size G: the fast loop takes tiles of one group.

    `dequant_keys` (the default) dequantizes a one-group tile's keys in registers and
    dots them with the query as loaded; False folds the group's scale into the query
    instead (one more conversion of the query per tile): equal results (tested), 7-8%
    slower on an H100 at 64 x 8K (`bench/kivi_kernels.py`). `block_g`: the rows the
    query heads of a KV head are padded to (default: the next power of two)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_codes.shape[1]
    if bits not in (2, 4) or k_codes.shape[2] * 8 // bits != head_dim:
        raise ValueError(f"codes {tuple(k_codes.shape)} do not hold {bits}-bit rows of {head_dim}")
    if head_dim != next_pow2(head_dim) or head_dim * bits // 8 < 16:
        raise ValueError(
            f"the KIVI decode kernel needs a power-of-two head_dim with planes of >= 16 "
            f"channels, got head_dim {head_dim} at {bits} bits"
        )
    if block_n != next_pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes), ("res_k", res_k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit-stride last dimension")
    if num_seqs == 0:
        return out
    groups, v_pairs = _as_pairs("key_groups", key_groups), _as_pairs("v_params", v_params)
    fast, tile_group = kivi_tile_plan(state, table, rows, view_lens, block_n)
    if num_splits is None:
        num_splits = auto_num_splits(num_seqs, num_kv_heads, table.shape[1], q.device)
    # Part i < num_splits: split i of the one-group tiles; the last part: the rest.
    ws_m, ws_l, ws_acc = split_workspace(num_seqs, num_q_heads, num_splits + 1, head_dim, q.device)
    group = num_q_heads // num_kv_heads
    block_g = next_pow2(group) if block_g is None else block_g
    common: dict[str, int | str] = dict(
        HEAD_DIM=head_dim, BITS=bits, GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n
    )
    common["DOT_PREC"] = dot_precision(q.dtype)
    qk_scale = float(scale) * LOG2E
    _kivi_decode_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, k_codes, v_codes, v_pairs, groups, table, rows, fast, tile_group,
        ws_m, ws_l, ws_acc, qk_scale,
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1),
        v_pairs.stride(0), v_pairs.stride(1), groups.stride(0), groups.stride(1),
        table.stride(0), tile_group.stride(0),
        NUM_SPLITS=num_splits,
        ASM=asm_unpack and q.dtype == torch.bfloat16 and q.is_cuda,
        KDEQ=dequant_keys, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    kivi_rest_kernel[(num_kv_heads, num_seqs)](
        q, k_codes, v_codes, v_pairs, state, groups, res_k, res_v, table, rows, view_lens,
        fast, ws_m, ws_l, ws_acc, qk_scale,
        q.stride(0), q.stride(1), k_codes.stride(0), k_codes.stride(1),
        v_pairs.stride(0), v_pairs.stride(1), groups.stride(0), groups.stride(1),
        res_k.stride(0), res_k.stride(1), table.stride(0),
        SPLIT=num_splits, NUM_PARTS=num_splits + 1, num_warps=2, num_stages=1, **common,
    )  # fmt: skip
    merge_splits(ws_m, ws_l, ws_acc, out)
    return out
