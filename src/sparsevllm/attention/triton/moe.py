"""Fused mixture-of-experts feed-forward: tokens grouped by expert, two grouped GEMMs.

Each token is routed to `top_k` experts; its `top_k` (token, expert) *assignments* are
numbered `t * top_k + j`. The launcher

1. groups the assignments by expert on the device (`align_by_expert`, one launch of
   `_align_kernel` at decode sizes): each expert's assignments in order, its run padded
   to a multiple of BLOCK_M with a sentinel, and the expert of every BLOCK_M block. The
   shapes depend on the token count only and nothing is read back to the host, so the
   whole layer can be captured in a CUDA graph;
2. runs the gate/up GEMM per block (`_gate_up_kernel`): one block's rows all use one
   expert, whose fused `[2I, H]` weight is read once per block and N tile; gate and up
   are accumulated side by side and `silu(gate) * up` is written per assignment;
3. runs the down GEMM (`_down_kernel`) the same way, scales each row by its routing
   weight and writes it per assignment; the `top_k` rows of a token are then summed
   (a deterministic reduction, no atomics).

Blocks past the last expert's run (the grid is sized for the worst case) return at once.
At decode (64 tokens x 8 of 128 experts) nearly every expert gets a few rows: each
expert's weights are then read once, which is the byte floor of the layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import (
    check_last_dim_contiguous,
    dot_precision,
    next_pow2,
)


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_assign,
    num_experts,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (b, n): rows of block b (one expert e), intermediate columns n-tile:
    out[a, n] = silu(x[a // TOP_K] . w[e, n]) * (x[a // TOP_K] . w[e, inter + n])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)  # [BLOCK_M] assignment ids; num_assign = padding
    valid = rows < num_assign
    tok = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_base = w_ptr + e * stride_we + offs_k[:, None]
    g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn  # [BLOCK_K, BLOCK_N]
    u_ptrs = w_base + (offs_n[None, :] + inter).to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = (offs_k + k0) < hidden
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wmask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(g_ptrs, mask=wmask, other=0.0)
        wu = tl.load(u_ptrs, mask=wmask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # The projections are rounded to the model dtype before the activation, as the
    # unfused layer computes them.
    gate = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, [BLOCK_M, BLOCK_N]
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    h_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_assign,
    num_experts,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (b, n): out[a, n] = routing_weight[a] * (h[a] . w[e, n]), n over hidden."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)  # [BLOCK_M]
    valid = rows < num_assign
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows64[:, None] * stride_ht + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = (offs_k + k0) < inter
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # Rounded to the model dtype before the routing weight, as the unfused layer does.
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    rw = tl.load(weights_ptr + rows64, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    o_ptrs = out_ptr + rows64[:, None] * stride_ot + offs_n[None, :]
    tl.store(o_ptrs, acc * rw[:, None], mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _align_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_assign,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program e < E: expert e's run of `sorted_ids` (its assignments in order, then
    padding) and its blocks' entries of `block_expert`; program E: the unused tail.
    Every program counts all experts itself (no inter-program communication)."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for a0 in range(0, num_assign, BLOCK_A):
        offs = a0 + tl.arange(0, BLOCK_A)
        ids = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1)  # [BLOCK_A]
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]; 0 past num_experts
    start = tl.sum(tl.where(offs_e < e, padded, 0), axis=0)  # first row of e's run
    if e < num_experts:
        count = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
        run = tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
        seen = 0
        for a0 in range(0, num_assign, BLOCK_A):
            offs = a0 + tl.arange(0, BLOCK_A)
            mine = tl.load(ids_ptr + offs, mask=offs < num_assign, other=-1) == e
            rank = seen + tl.cumsum(mine.to(tl.int32), axis=0) - 1  # order kept: stable
            tl.store(sorted_ptr + start + rank, offs.to(tl.int32), mask=mine)
            seen += tl.sum(mine.to(tl.int32), axis=0)
        pad = count + tl.arange(0, BLOCK_M)  # at most BLOCK_M - 1 padding rows
        tl.store(sorted_ptr + start + pad, num_assign, mask=pad < run)
        blocks = start // BLOCK_M + tl.arange(0, BLOCK_A)
        for b0 in range(0, run // BLOCK_M, BLOCK_A):
            tl.store(block_expert_ptr + b0 + blocks, e, mask=b0 + blocks < (start + run) // BLOCK_M)
    else:
        total = start  # e == num_experts: the sum of every run
        for b0 in range(total // BLOCK_M, num_blocks, BLOCK_A):
            offs = b0 + tl.arange(0, BLOCK_A)
            tl.store(block_expert_ptr + offs, num_experts, mask=offs < num_blocks)
        for r0 in range(total, num_blocks * BLOCK_M, BLOCK_A):
            offs = r0 + tl.arange(0, BLOCK_A)
            tl.store(sorted_ptr + offs, num_assign, mask=offs < num_blocks * BLOCK_M)


# Assignments up to which one Triton launch groups them (decode: 512 at 64 x 8): every
# program scans all of them, so the cost grows with E x A; above, the torch ops below
# (about 25 launches, negligible next to a prefill chunk's GEMMs).
MAX_KERNEL_ALIGN = 4096


def num_padded_blocks(num_assign: int, num_experts: int, block_m: int) -> int:
    """Blocks in the worst case: every used expert's run padded by up to BLOCK_M - 1."""
    worst = num_assign + min(num_experts, num_assign) * (block_m - 1)
    return -(-worst // block_m)


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, K] expert of each assignment
    num_experts: int,
    block_m: int,
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments grouped by expert, each expert's run padded to a multiple of block_m.

    Returns `sorted_ids` `[num_blocks * block_m]` (assignment ids in their order within
    each run, `T * K` where padding) and `block_expert` `[num_blocks]` (the expert of each
    block; `num_experts` for blocks past the last run). Device-side throughout: no value
    is read back to the host. One Triton launch for up to MAX_KERNEL_ALIGN assignments
    (`use_kernel` forces a choice), torch ops above; both give the same tensors.
    """
    num_assign = topk_ids.numel()
    if use_kernel is None:
        use_kernel = num_assign <= MAX_KERNEL_ALIGN
    if not use_kernel:
        return _align_torch(topk_ids, num_experts, block_m)
    num_blocks = num_padded_blocks(num_assign, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    _align_kernel[(num_experts + 1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, num_assign, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK_A=32, BLOCK_E=next_pow2(num_experts),
    )  # fmt: skip
    return sorted_ids, block_expert


def _align_torch(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_by_expert` as torch ops: a stable sort of the expert ids."""
    flat = topk_ids.reshape(-1).long()  # [A]
    num_assign = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    rank_base = padded_end - padded - (torch.cumsum(counts, 0) - counts)  # [E]
    order = torch.argsort(flat, stable=True)  # [A] assignment ids, grouped by expert
    sorted_experts = flat[order]
    dest = rank_base[sorted_experts] + torch.arange(num_assign, device=device)  # [A]
    num_blocks = num_padded_blocks(num_assign, num_experts, block_m)
    sorted_ids = torch.full((num_blocks * block_m,), num_assign, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=device) * block_m  # [num_blocks]
    # The expert whose padded run holds the block's first row (runs of empty experts
    # have no length and are skipped by right=True); past the last run: num_experts.
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert


def moe_block_sizes(num_assign: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the shapes only (graph-safe).

    Few rows per expert (decode): BLOCK_M 16, the smallest tl.dot tile, so padding wastes
    little compute while each expert's weights are still read once. Many rows
    (prefill): BLOCK_M 64 re-reads the weights a quarter as often.
    """
    rows_per_expert = num_assign / max(1, num_experts)
    if rows_per_expert <= 32:
        return 16, 64, 128
    return 64, 64, 64


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]: gate rows then up rows per expert
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    block_sizes: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),
    e = topk_ids[t, j]: the SwiGLU experts' output `[T, H]` in x's dtype."""
    t, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if gate_up.shape[2] != hidden or down.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"bad expert shapes: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)}"
        )
    if topk_ids.shape != (t, top_k) or topk_weights.shape != (t, top_k):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{t}, top_k]"
        )
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("expert weights must be contiguous")
    check_last_dim_contiguous("x", x)
    num_assign = t * top_k
    if num_assign == 0:
        return torch.zeros_like(x)
    bm, bn, bk = block_sizes or moe_block_sizes(num_assign, num_experts)
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, bm)
    num_blocks = block_expert.numel()
    prec = dot_precision(x.dtype)
    h = torch.empty((num_assign, inter), dtype=x.dtype, device=x.device)  # [A, I]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, gate_up, h, sorted_ids, block_expert, num_assign, num_experts, hidden, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec,
    )  # fmt: skip
    out = torch.empty((num_assign, hidden), dtype=torch.float32, device=x.device)  # [A, H]
    weights = topk_weights.reshape(-1).contiguous()  # [A]
    _down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        h, down, weights, out, sorted_ids, block_expert, num_assign, num_experts, hidden,
        inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec,
    )  # fmt: skip
    return out.view(t, top_k, hidden).sum(1).to(x.dtype)
