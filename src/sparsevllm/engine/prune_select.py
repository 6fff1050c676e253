"""Which cached tokens a prune keeps: scoring a view's entries and choosing per range.

Scores reuse the sparse methods' rules, computed from what a cached history still has:
its keys (queries are not kept).

- `knorm`: a lower key norm is more important (KNorm's rule); needs only keys.
- `snapkv`: SnapKV's vote, with the *keys* of the history's last `window` resident
  tokens standing in for the observation queries (causal by logical position, summed
  over the window, max-pooled along the view). Queries and keys of a token come from
  the same hidden state, so its key is the closest stand-in the cache holds; the end of
  the history is what the next turn continues from, as SnapKV's prompt end is.
- `streamingllm`: position only: each range keeps its most recent tokens.
"""

from __future__ import annotations

import math

import torch

from sparsevllm.sparse.snapkv import snapkv_scores

PRUNE_METHODS = ("knorm", "snapkv", "streamingllm")


def score_entries(
    method: str, keys: torch.Tensor, positions: torch.Tensor, window: int, kernel: int
) -> torch.Tensor:
    """Importance of every view entry, per KV head (higher is kept).

    keys: `[L, Hkv, D]` (row j: each head's j-th entry); positions: `[Hkv, L]` logical
    position of each entry. Returns `[Hkv, L]` float32.
    """
    if method == "knorm":
        return -keys.float().norm(dim=-1).t()
    if method == "streamingllm":
        return positions.float()
    if method == "snapkv":
        return _snapkv(keys.float(), positions, window, kernel)
    raise ValueError(f"method must be one of {', '.join(PRUNE_METHODS)}; got {method!r}")


def _snapkv(keys: torch.Tensor, positions: torch.Tensor, window: int, kernel: int) -> torch.Tensor:
    w = min(window, keys.shape[0])
    k = keys.transpose(0, 1)  # [Hkv, L, D]
    q = k[:, -w:]  # [Hkv, w, D]: the last entries' keys as observation queries
    logits = q @ k.transpose(1, 2) / math.sqrt(k.shape[-1])  # [Hkv, w, L]
    future = positions[:, None, :] > positions[:, -w:, None]  # [Hkv, w, L]
    attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return snapkv_scores(attn.sum(dim=1), k.shape[0], kernel)  # [Hkv, L]


def combine(scores: list[torch.Tensor]) -> torch.Tensor:
    """One score per entry for storage shared by several heads and layers: `[1, L]`.

    Each layer's `[Hkv, L]` scores are standardised first, so that no layer dominates
    through its scale (key norms differ widely across layers).
    """
    total = torch.zeros_like(scores[0][0])
    for s in scores:
        total += ((s - s.mean()) / (s.std(unbiased=False) + 1e-6)).mean(dim=0)
    return total[None]


def kept_count(keep_ratio: float, count: int) -> int:
    """ceil(keep_ratio * count), without float noise turning 0.3 * 10 into 4."""
    return math.ceil(keep_ratio * count - 1e-9)


def select_keep(
    scores: torch.Tensor,
    positions: torch.Tensor,
    ranges: list[tuple[int, int]],
    keep_ratio: float,
) -> torch.Tensor:
    """View positions to keep, `[H, B]` ascending per row (H heads, or 1 for shared).

    Entries outside the ranges are all kept. A range holding c resident entries (the
    fewest over the heads, when views differ per head) keeps ceil(keep_ratio * c) of
    them; every head drops the same number, its lowest-scored, so all heads keep B.
    """
    h, length = scores.shape
    dropped = torch.zeros((h, length), dtype=torch.bool, device=scores.device)
    num_dropped = 0
    for start, end in ranges:
        inside = (positions >= start) & (positions < end)  # [H, L]
        count = int(inside.sum(dim=1).min())
        n = count - kept_count(keep_ratio, count)
        if n <= 0:
            continue
        masked = scores.masked_fill(~inside, float("inf"))
        dropped.scatter_(1, masked.topk(n, dim=1, largest=False).indices, True)
        num_dropped += n
    order = torch.arange(length, device=scores.device).expand(h, length)
    order = order.masked_fill(dropped, length)  # dropped entries sort last
    return order.sort(dim=1).values[:, : length - num_dropped]
