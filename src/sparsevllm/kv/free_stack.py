"""A stack of free row ids that lives on the device.

Storage formats that keep rows beside their slots (KIVI's full-precision residual rows,
kv/kivi.py) hand one out per stored token. With the free ids in a host list, every store
had to know on the host which of its tokens are real (a -1 slot pads a captured batch),
and giving rows back meant reading the freed slots' state: each a wait for the device,
once per layer and step, and no store could run inside a captured CUDA graph. Here taking
and giving back are masked tensor operations of fixed shapes: no host sync, capturable.

The stack holds `num_rows` ids (0 .. num_rows - 1) and one spare position past them:
masked-out entries of `take` get the id `trash` (= num_rows, so the caller keeps one row
more than it hands out, which absorbs padded writes), and masked-out entries of `give`
are scattered to the spare position. The lowest height the stack reached is kept on the
device, so a caller can check at a point where it waits anyway that it never ran dry.
"""

from __future__ import annotations

import torch


class DeviceFreeStack:
    """Free row ids `0 .. num_rows - 1` on `device` (module docstring)."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.num_rows = num_rows
        self.trash = num_rows
        # [num_rows + 1]: the ids from the bottom up, then the spare position. Rows are
        # handed out from the top: 0 first, as a fresh pool would.
        self.ids = torch.zeros(num_rows + 1, dtype=torch.long, device=device)
        self.ids[:num_rows] = torch.arange(num_rows - 1, -1, -1, dtype=torch.long, device=device)
        self.top = torch.full((1,), num_rows, dtype=torch.long, device=device)
        self.low = self.top.clone()  # the lowest `top` since the last check

    def take(self, want: torch.Tensor) -> torch.Tensor:
        """One free id for every True entry of `want` `[n]` (bool), in order, and
        `trash` for the others: `[n]` int64."""
        if want.numel() == 0:
            return torch.empty(0, dtype=torch.long, device=want.device)
        rank = want.long().cumsum(0)  # [n]: 1 for the first wanted entry
        at = (self.top - rank).clamp(min=0)  # clamped: an empty stack must not read out of bounds
        ids = torch.where(want, self.ids[at], self.trash)
        self.top.sub_(rank[-1:])
        torch.minimum(self.low, self.top, out=self.low)
        return ids

    def give(self, ids: torch.Tensor, keep: torch.Tensor) -> None:
        """Push `ids[i]` for every True `keep[i]` (`[n]` int64 and bool)."""
        if ids.numel() == 0:
            return
        rank = keep.long().cumsum(0)
        at = torch.where(keep, self.top + rank - 1, self.num_rows).clamp(max=self.num_rows)
        self.ids.scatter_(0, at, ids.long())
        self.top.add_(rank[-1:])

    @property
    def num_free(self) -> int:
        """How many ids are free (waits for the device)."""
        return int(self.top)

    def ran_dry(self) -> int:
        """How many more ids than were free some `take` since the last call asked for
        (0: none; waits for the device). Resets the record."""
        short = max(0, -int(self.low))
        self.low.copy_(self.top)
        return short
