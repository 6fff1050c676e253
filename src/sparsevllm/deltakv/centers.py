"""DeltaKV's reference rule: which tokens stay full precision (centers) and which centers
each compressed token is a residual against.

Positions p < `sink` are sink tokens; p >= sink is a center when (p - sink) is a
multiple of `stride`. Both are kept in full precision and both serve as references.
Every other token t is compressed against its R = `num_references` nearest centers
c < t, nearest in squared L2 distance between the tokens' full vectors (pre-RoPE K of
every KV head, then V), ties to the earlier center. The rule depends on positions and on
vectors known when t is computed, so it gives the same answer whatever the chunking.
"""

from __future__ import annotations

import torch


def is_center(positions: torch.Tensor, sink: int, stride: int) -> torch.Tensor:
    """Bool mask over `positions` (any shape, int): sink tokens and strided centers."""
    return (positions < sink) | ((positions - sink) % stride == 0)


def center_positions(length: int, sink: int, stride: int) -> torch.Tensor:
    """Positions of the full-precision references in a sequence of `length`: `[M]` int64."""
    pos = torch.arange(length)
    return pos[is_center(pos, sink, stride)]


def compressed_positions(length: int, sink: int, stride: int) -> torch.Tensor:
    """Positions stored as latent residuals: `[N]` int64, every non-center."""
    pos = torch.arange(length)
    return pos[~is_center(pos, sink, stride)]


def select_references(
    x: torch.Tensor,
    sink: int,
    stride: int,
    num_references: int,
    chunk: int = 1024,
) -> torch.Tensor:
    """The references of every compressed token of one sequence at one layer.

    x: `[T, C]` the sequence's token vectors (C = kv_dim), in the dtype distances are
    computed in. Returns `[N, R]` int64 center positions, row i for the i-th entry of
    `compressed_positions(T, ...)`, nearest first.
    """
    length = x.shape[0]
    centers = center_positions(length, sink, stride).to(x.device)  # [M]
    targets = compressed_positions(length, sink, stride).to(x.device)  # [N]
    if targets.numel() and centers.numel() < num_references:
        raise ValueError(f"{centers.numel()} centers cannot give {num_references} references")
    xc = x[centers]  # [M, C]
    xc_sq = (xc * xc).sum(-1)  # [M]
    out = torch.empty((targets.numel(), num_references), dtype=torch.long, device=x.device)
    for lo in range(0, targets.numel(), chunk):
        t = targets[lo : lo + chunk]  # [n]
        xt = x[t]  # [n, C]
        dist = (xt * xt).sum(-1, keepdim=True) + xc_sq[None, :] - 2.0 * (xt @ xc.T)  # [n, M]
        dist = dist.masked_fill(centers[None, :] > t[:, None], float("inf"))
        order = torch.sort(dist, dim=-1, stable=True).indices[:, :num_references]  # [n, R]
        out[lo : lo + chunk] = centers[order]
    return out
