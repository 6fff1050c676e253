"""Copying KV rows between the pool's tensors and host memory, for the tier stack.

An entry's KV is addressed per pool group: `slots[g]` lists its slots in group g, in
view order, and every layer of the group reads rows at those slots. Host copies keep,
per layer, `(K, V)` of shape `[len(slots[g]), Hkv, D]` in the same order, so writing
them back to new slots in that order restores the view bit-identically.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sparsevllm.upload import upload

# An entry's KV off the device: per layer (K, V), each `[rows, Hkv, D]` in view order.
HostRows = list[tuple[torch.Tensor, torch.Tensor]]
# Per-entry device state besides the rows, as host tensors and plain values that
# `torch.save` writes (a chain's view positions and method state).
StatePayload = dict[str, object]


class KVBytes(Protocol):
    """The tier stack's access to the KV bytes of the pool."""

    def gather(self, slots: list[list[int]], pin: bool) -> HostRows:
        """Host copies of every layer's K/V rows at its group's `slots` (in order)."""

    def scatter(self, slots: list[list[int]], rows: HostRows) -> None:
        """Write `rows` back to every layer's K/V at its group's `slots`."""

    def nbytes(self, counts: list[int]) -> int:
        """Bytes of the rows of an entry with `counts[g]` rows in group g."""


class KVRows:
    """`KVBytes` over the runner's per-layer K/V tensors `[num_slots, Hkv, D]`."""

    def __init__(
        self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], group_of_layer: list[int]
    ) -> None:
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.group_of_layer = group_of_layer

    def _index(self, slots: list[list[int]]) -> list[torch.Tensor]:
        """Device slot ids per group (one conversion per group, not per layer: a group
        may hold every layer)."""
        device = self.k_cache[0].device
        return [upload(s, torch.long, device) for s in slots]

    def gather(self, slots: list[list[int]], pin: bool) -> HostRows:
        index = self._index(slots)
        rows = []
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            at = index[self.group_of_layer[layer]]
            rows.append((to_host(k[at], pin), to_host(v[at], pin)))
        if self.k_cache[0].is_cuda:
            torch.cuda.synchronize(self.k_cache[0].device)  # the copies must land before reuse
        return rows

    def scatter(self, slots: list[list[int]], rows: HostRows) -> None:
        index = self._index(slots)
        for layer, (k, v) in enumerate(rows):
            at = index[self.group_of_layer[layer]]
            self.k_cache[layer][at] = k.to(self.k_cache[layer].device)
            self.v_cache[layer][at] = v.to(self.v_cache[layer].device)

    def nbytes(self, counts: list[int]) -> int:
        total = 0
        for layer, k in enumerate(self.k_cache):
            row = k[0].numel() * k.element_size() * 2  # K and V
            total += counts[self.group_of_layer[layer]] * row
        return total


def rows_nbytes(rows: HostRows) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in rows)


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t` (pinned on CUDA when asked; the caller synchronises)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=pin and t.is_cuda)
    return out
