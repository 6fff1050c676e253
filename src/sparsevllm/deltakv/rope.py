"""Moving keys between the pool's post-RoPE form and the pre-RoPE form DeltaKV compresses.

The engine's rotation is rotate-half with per-pair angle `position x freq[i]`
(`layers/rotary.py`, `KVAccess.rope_frequencies`). `unrotate` turns it back by the pure
rotation, so any factor a RoPE variant puts on cos and sin (YaRN's attention factor)
stays in the pre-RoPE key and `rotate` puts the rotation alone back: the round trip is
exact up to float rounding, which is all the compressor needs.
"""

from __future__ import annotations

import torch


def _angles(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[n, 1, D/2]` float32 of positions `[n]` and frequencies `[D/2]`."""
    angles = positions.to(torch.float32)[:, None] * freqs.to(positions.device, torch.float32)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
    """Pre-RoPE `[n, H, D]` at `positions` `[n]` -> post-RoPE, float32 (None: no RoPE)."""
    if freqs is None:
        return x.float()
    cos, sin = _angles(positions, freqs)
    return _turn(x, cos, sin)


def unrotate(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
    """Post-RoPE `[n, H, D]` at `positions` `[n]` -> pre-RoPE, float32 (None: no RoPE)."""
    if freqs is None:
        return x.float()
    cos, sin = _angles(positions, freqs)
    return _turn(x, cos, -sin)
