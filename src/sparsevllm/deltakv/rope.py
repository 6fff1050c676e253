"""Moving keys between the pool's post-RoPE form and the pre-RoPE form DeltaKV compresses.

The engine's rotation is rotate-half with per-pair angle `position x freq[i]`
(`layers/rotary.py`, `KVAccess.rope_frequencies`). `unrotate` turns it back by the pure
rotation, so any factor a RoPE variant puts on cos and sin (YaRN's attention factor)
stays in the pre-RoPE key and `rotate` puts the rotation alone back: the round trip is
exact up to float rounding, which is all the compressor needs.
"""

from __future__ import annotations

import torch

RopeTable = tuple[torch.Tensor, torch.Tensor]  # cos, sin [P, D/2] float32
# Fewest positions a cached table covers: it grows by doubling, so a generation rebuilds
# it a few times at most.
MIN_TABLE_POSITIONS = 1024


def _angle_grid(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Angles `[n, D/2]` float32 of positions `[n]` and frequencies `[D/2]`."""
    return positions.to(torch.float32)[:, None] * freqs.to(positions.device, torch.float32)


def _angles(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[n, 1, D/2]` float32 of positions `[n]` and frequencies `[D/2]`."""
    angles = _angle_grid(positions, freqs)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def rope_table(freqs: torch.Tensor, num_positions: int) -> RopeTable:
    """cos, sin `[num_positions, D/2]` float32 of positions 0..num_positions-1, the values
    `rotate` and `unrotate` use (same angles, torch's cos and sin on the frequencies'
    device): what the DeltaKV kernels read instead of evaluating sin/cos per element.
    ~0.5 KB per position at D 128 (16 MiB at 32K): build it once (`RopeTables`)."""
    angles = _angle_grid(torch.arange(num_positions, device=freqs.device), freqs)
    return angles.cos().contiguous(), angles.sin().contiguous()


class RopeTables:
    """`rope_table`s built once per RoPE (frequencies tensor and device) and grown by
    doubling as positions pass them, so the layers of a model share one."""

    def __init__(self) -> None:
        # The frequencies are kept with their table, so their address stays theirs.
        self._tables: dict[tuple[int, torch.device], tuple[torch.Tensor, RopeTable]] = {}

    def get(self, freqs: torch.Tensor, device: torch.device, num_positions: int) -> RopeTable:
        """cos, sin `[P, D/2]` of `freqs` on `device`, P >= `num_positions`."""
        key = (freqs.data_ptr(), device)
        hit = self._tables.get(key)
        if hit is None or hit[1][0].shape[0] < num_positions:
            size = max(MIN_TABLE_POSITIONS, 1 << max(0, num_positions - 1).bit_length())
            hit = (freqs, rope_table(freqs.to(device), size))
            self._tables[key] = hit
        return hit[1]


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
