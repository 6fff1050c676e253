"""Which cached tokens a prune keeps: scoring a view's entries and choosing per range.

Scores come from the sparse method named as the scorer (its spec's `prune_scorer`),
computed from what a cached history still has: its keys (queries are not kept).
"""

from __future__ import annotations

import math

import torch

from sparsevllm.sparse.base import MethodSettings
from sparsevllm.sparse.registry import all_specs, canonical_method_name, method_spec


def prune_methods() -> list[str]:
    """The methods that can score a cached history."""
    return [spec.name for spec in all_specs() if spec.prune_scorer is not None]


def check_prune_method(method: object) -> str:
    """The canonical name of a scorer method; a clear error for any other value."""
    valid = ", ".join(prune_methods())
    if not isinstance(method, str):
        raise ValueError(f"method must be one of {valid}; got {method!r}")
    try:
        name = canonical_method_name(method)
    except ValueError:
        raise ValueError(f"method must be one of {valid}; got {method!r}") from None
    if method_spec(name).prune_scorer is None:
        raise ValueError(f"method must be one of {valid}; {name} cannot score a cached history")
    return name


def score_entries(
    method: str, keys: torch.Tensor, positions: torch.Tensor, settings: MethodSettings
) -> torch.Tensor:
    """Importance of every view entry, per KV head (higher is kept), by `method`'s rule,
    with the engine's knobs when they are that method's, else the method's defaults.

    keys: `[L, Hkv, D]` (row j: each head's j-th entry); positions: `[Hkv, L]` logical
    position of each entry. Returns `[Hkv, L]` float32.
    """
    spec = method_spec(method)
    if spec.prune_scorer is None:
        raise ValueError(f"{spec.name} cannot score a cached history")
    # A method whose knobs extend the scorer's (PyramidKV's extend SnapKV's) lends them.
    own = isinstance(settings.method_knobs, spec.knobs)
    knobs = settings.method_knobs if own else spec.knobs()
    return spec.prune_scorer(keys, positions, knobs).float()


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
