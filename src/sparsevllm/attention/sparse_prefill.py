"""Block-sparse prefill: which key blocks each query block of a chunk attends to.

The vertical-slash rule (after MInference; FlexPrefill's query-aware estimation from the
last queries): for one sequence's chunk in one full-attention layer, the chunk's last
`last_q` queries are attended (causally) over the whole view, their probabilities summed
over the G query heads of each KV head and pooled into key blocks of `block_n` tokens:

    mass[h, r, b]    probability of estimation row r on key block b      [Hkv, R, nkb]
    vertical[h, b]   sum_r mass[h, r, b]                  (a column of the attention map)
    slash[h, o]      sum_r mass[h, r, p_r // block_n - o] (a block diagonal, offset o)

Each KV head keeps block 0 (the attention sink), the diagonal offsets 0 and 1 (the local
window), its top `vertical_blocks` key blocks and its top `slash_blocks` offsets. A
query block of `block_m` chunk rows (positions first..last) then reads key block b when
b is kept as a column, or some key-block row rb of its rows (first // block_n ..
last // block_n) has a kept offset rb - b; always b <= last // block_n (causality). The
result is MInference's format: `block_count [Hkv, nqb]` and `block_index [Hkv, nqb, B]`,
each query block's key blocks ascending. Every block a query block's diagonal touches is
in its list (offset 0), so the kernels mask only those and every row sees a key.

Everything here runs on any device, vectorised over heads and blocks (no host syncs); it
is also the torch backend's sparse prefill and the Triton kernel's test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Tile sizes the selection is made for: the sparse kernel's BLOCK_M x BLOCK_N.
BLOCK_M = 128
BLOCK_N = 64
# Diagonal offsets always kept: the key block of a query's own position and the one before.
LOCAL_OFFSETS = 2


@dataclass(frozen=True)
class PrefillSparsity:
    """How the backends sparsify prefill attention (the engine's prefill_sparse_* settings;
    the backends get None when prefill_sparse_method is off)."""

    min_len: int = 8192  # views shorter than this stay dense
    vertical_blocks: int = 24
    slash_blocks: int = 12
    last_q: int = 64
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N

    def applies(self, q_len: int, view_len: int) -> bool:
        """Whether a chunk of `q_len` queries over a view of `view_len` goes sparse: it
        needs more rows than the estimation reads and a view of at least min_len."""
        return q_len > self.last_q and view_len >= self.min_len

    def max_blocks(self, view_len: int) -> int:
        """Upper bound of any query block's list length (sizes block_index, no sync): the
        sink, the columns, and per kept offset every key-block row a query block spans."""
        num_kb = -(-view_len // self.block_n)
        rows_spanned = (self.block_m - 1) // self.block_n + 2
        bound = 1 + self.vertical_blocks + (self.slash_blocks + LOCAL_OFFSETS) * rows_spanned
        return min(num_kb, bound)


def block_mass_reference(
    q_rows: torch.Tensor,  # [R, Hq, D] the chunk's last R queries
    keys: torch.Tensor,  # [L, Hkv, D] the view's keys (the rows' own keys last)
    scale: float,
    block_n: int,
) -> torch.Tensor:  # [Hkv, R, nkb] float32
    """Causal softmax of the view's last R queries, summed over each KV head's query heads
    and pooled into key blocks of `block_n` (the Triton path: prefill_sparse.block_mass)."""
    r, hq, d = q_rows.shape
    length, hkv, _ = keys.shape
    qf = q_rows.float().view(r, hkv, hq // hkv, d)  # [R, Hkv, G, D]
    logits = torch.einsum("rhgd,lhd->hgrl", qf, keys.float()) * scale  # [Hkv, G, R, L]
    rows = torch.arange(r, device=keys.device)[:, None] + (length - r)  # [R, 1]
    hidden = torch.arange(length, device=keys.device)[None, :] > rows  # [R, L]
    probs = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1).sum(dim=1)  # [Hkv, R, L]
    num_kb = -(-length // block_n)
    probs = F.pad(probs, (0, num_kb * block_n - length))
    return probs.view(hkv, r, num_kb, block_n).sum(dim=-1)


def _top_mask(scores: torch.Tensor, k: int, skip: int) -> torch.Tensor:
    """[H, n] bool: the top-k entries of each row among indices >= skip."""
    out = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    k = min(k, scores.shape[-1] - skip)
    if k > 0:
        top = scores[:, skip:].topk(k, dim=-1).indices + skip  # [H, k]
        out.scatter_(-1, top, True)
    return out


def pattern_scores(
    mass: torch.Tensor,  # [Hkv, R, nkb]
    view_len: int,
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # vertical [Hkv, nkb], slash [Hkv, nkb]
    """Column mass per key block and diagonal mass per block offset (see the module doc)."""
    hkv, r, num_kb = mass.shape
    vertical = mass.sum(dim=1)
    pos = torch.arange(r, device=mass.device) + (view_len - r)  # [R] rows' view positions
    offs = torch.arange(num_kb, device=mass.device)  # [nkb] offsets o
    col = (pos // block_n)[:, None] - offs[None, :]  # [R, nkb] key block at offset o
    valid = col >= 0
    picked = mass.gather(-1, col.clamp(min=0).expand(hkv, r, num_kb))  # [Hkv, R, nkb]
    slash = (picked * valid).sum(dim=1)
    return vertical, slash


def select_blocks(
    mass: torch.Tensor,  # [Hkv, R, nkb] from block_mass(_reference)
    q_len: int,
    view_len: int,
    cfg: PrefillSparsity,
) -> tuple[torch.Tensor, torch.Tensor]:  # block_count [Hkv, nqb], block_index [Hkv, nqb, B]
    """The vertical-slash rule: each query block's key blocks, ascending (int32)."""
    bm, bn = cfg.block_m, cfg.block_n
    hkv, _, num_kb = mass.shape
    device = mass.device
    vertical, slash = pattern_scores(mass, view_len, bn)
    keep_col = _top_mask(vertical, cfg.vertical_blocks, skip=1)  # [Hkv, nkb]
    keep_col[:, 0] = True  # the sink
    keep_off = _top_mask(slash, cfg.slash_blocks, skip=LOCAL_OFFSETS)  # [Hkv, nkb]
    keep_off[:, :LOCAL_OFFSETS] = True
    # Kept offsets in the range [lo, hi] <=> a prefix-sum difference > 0.
    csum = F.pad(keep_off.cumsum(dim=-1, dtype=torch.int32), (1, 0))  # [Hkv, nkb + 1]
    num_qb = -(-q_len // bm)
    prefix = view_len - q_len
    qb = torch.arange(num_qb, device=device)
    first = prefix + qb * bm  # [nqb] first and last query position of each query block
    last = prefix + torch.clamp((qb + 1) * bm, max=q_len) - 1
    row_lo, row_hi = first // bn, last // bn  # [nqb] key-block rows the block spans
    kb = torch.arange(num_kb, device=device)
    causal = kb[None, :] <= row_hi[:, None]  # [nqb, nkb]
    hi = (row_hi[:, None] - kb[None, :]).clamp(min=0, max=num_kb - 1)  # [nqb, nkb]
    lo = (row_lo[:, None] - kb[None, :]).clamp(min=0, max=num_kb - 1)
    flat = (num_qb * num_kb,)
    hits = csum[:, (hi + 1).reshape(flat)] - csum[:, lo.reshape(flat)]  # [Hkv, nqb * nkb]
    mask = (hits.view(hkv, num_qb, num_kb) > 0) | keep_col[:, None, :]
    mask &= causal[None]  # [Hkv, nqb, nkb]
    return _compact(mask, cfg.max_blocks(view_len))


def _compact(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, nqb, nkb] bool -> counts [H, nqb] and the set indices ascending [H, nqb, width]
    (entries past a count are 0); `width` must bound every count. No sort, no sync."""
    pos = mask.cumsum(dim=-1, dtype=torch.int32)  # [H, nqb, nkb] 1-based rank of set bits
    count = pos[..., -1].contiguous()
    dest = torch.where(mask, pos - 1, width).long()  # unset bits go to a spare column
    src = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.int32)
    index = torch.zeros((*mask.shape[:2], width + 1), dtype=torch.int32, device=mask.device)
    index.scatter_(-1, dest, src.expand(mask.shape).contiguous())
    index[..., width] = 0
    return count, index[..., :width].contiguous()


def block_sparse_mask(
    block_count: torch.Tensor,  # [Hkv, nqb]
    block_index: torch.Tensor,  # [Hkv, nqb, B]
    q_len: int,
    view_len: int,
    block_m: int,
    block_n: int,
) -> torch.Tensor:  # [Hkv, q_len, L] bool
    """Token-level mask of a block selection: query i sees key j iff j's block is in its
    query block's list and j <= its view position."""
    hkv, num_qb, width = block_index.shape
    num_kb = -(-view_len // block_n)
    listed = torch.arange(width, device=block_index.device) < block_count[..., None]
    blocks = torch.zeros((hkv, num_qb, num_kb + 1), dtype=torch.bool, device=block_index.device)
    # Unlisted entries go to a spare column, dropped below.
    blocks.scatter_(-1, torch.where(listed, block_index, num_kb).long(), True)
    blocks = blocks[..., :num_kb]
    qb = torch.arange(q_len, device=block_index.device) // block_m  # [n]
    kb = torch.arange(view_len, device=block_index.device) // block_n  # [L]
    mask = blocks[:, qb][:, :, kb]  # [Hkv, n, L]
    rows = torch.arange(q_len, device=block_index.device)[:, None] + (view_len - q_len)
    return mask & (torch.arange(view_len, device=block_index.device)[None, :] <= rows)


# Most mask entries (query heads x rows x keys) attend_block_sparse builds at once.
REFERENCE_MASK_ELEMENTS = 1 << 28


def attend_block_sparse(
    q: torch.Tensor,  # [n, Hq, D] the chunk's queries
    k: torch.Tensor,  # [L, Hkv, D] the view's keys, the chunk's own last
    v: torch.Tensor,  # [L, Hkv, Dv]
    scale: float,
    block_count: torch.Tensor,  # [Hkv, nqb]
    block_index: torch.Tensor,  # [Hkv, nqb, B]
    block_m: int,
    block_n: int,
) -> torch.Tensor:  # [n, Hq, Dv]
    """Plain attention under the block-sparse mask (the reference of the Triton kernel),
    a few query blocks at a time so the token-level mask stays bounded."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    kt = k.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, Hq, L, D]
    vt = v.to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)[None]
    blocks_per_piece = max(1, REFERENCE_MASK_ELEMENTS // (hq * length * block_m))
    out = q.new_empty(n, hq, v.shape[-1])
    for qb0 in range(0, block_count.shape[1], blocks_per_piece):
        qb1 = min(qb0 + blocks_per_piece, block_count.shape[1])
        lo, hi = qb0 * block_m, min(qb1 * block_m, n)
        # The piece's rows are the view's entries up to length - (n - hi): its own view.
        view = length - (n - hi)
        mask = block_sparse_mask(
            block_count[:, qb0:qb1], block_index[:, qb0:qb1], hi - lo, view, block_m, block_n
        )  # [Hkv, hi - lo, view]
        mask = mask.repeat_interleave(group, dim=0)[None]  # [1, Hq, hi - lo, view]
        piece = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1)[None], kt[:, :, :view], vt[:, :, :view], attn_mask=mask,
            scale=scale,
        )  # fmt: skip
        out[lo:hi] = piece[0].transpose(0, 1)
    return out


def estimate_reference(
    q: torch.Tensor,  # [n, Hq, D] the chunk's queries
    k: torch.Tensor,  # [L, Hkv, D] the view's keys
    scale: float,
    cfg: PrefillSparsity,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of one chunk from its view's keys (torch): block_count, block_index."""
    mass = block_mass_reference(q[-cfg.last_q :], k, scale, cfg.block_n)
    return select_blocks(mass, q.shape[0], k.shape[0], cfg)


def density(block_count: torch.Tensor, q_len: int, view_len: int, cfg: PrefillSparsity) -> float:
    """Visited key blocks over the causal ones (a host sync: for benchmarks and tests)."""
    num_qb = block_count.shape[1]
    qb = torch.arange(num_qb)
    last = view_len - q_len + torch.clamp((qb + 1) * cfg.block_m, max=q_len) - 1
    causal = (last // cfg.block_n + 1).sum().item() * block_count.shape[0]
    return float(block_count.sum().item()) / float(causal)
