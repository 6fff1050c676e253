"""Copying KV rows between the pool's storage and host memory, for the tier stack.

An entry's KV is addressed per pool group: `slots[g]` lists its slots in group g, in
view order, and every layer of the group reads rows at those slots. Host copies keep,
per layer, every buffer of the layer's storage format by name (`k`, `v`, and the
scales of a quantized format), each `[len(slots[g]), Hkv, ...]` in the same order and
in the stored form, so writing them back to new slots in that order restores the view
bit-identically and a quantized entry moves only its quantized bytes. The same rows
also move from slots to other slots on the device (`KVRows.copy`, for copies of a cached
entry: `PrefixStore.clone`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from sparsevllm.kv.format import KVStorage
from sparsevllm.upload import upload

# An entry's KV off the device: per layer, buffer name -> `[rows, Hkv, ...]` in view order.
HostRows = list[dict[str, torch.Tensor]]
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
    """`KVBytes` over the runner's per-layer storage (any format)."""

    def __init__(self, storage: list[KVStorage], group_of_layer: list[int]) -> None:
        self.storage = storage
        self.group_of_layer = group_of_layer

    def _index(self, slots: list[list[int]]) -> list[torch.Tensor]:
        """Device slot ids per group (one conversion per group, not per layer: a group
        may hold every layer)."""
        device = self.storage[0].device
        return [upload(s, torch.long, device) for s in slots]

    def gather(self, slots: list[list[int]], pin: bool) -> HostRows:
        index = self._index(slots)
        rows = []
        for layer, storage in enumerate(self.storage):
            at = index[self.group_of_layer[layer]]
            rows.append({n: to_host(t, pin) for n, t in storage.gather_rows(at).items()})
        if self.storage[0].device.type == "cuda":
            torch.cuda.synchronize(self.storage[0].device)  # the copies must land before reuse
        return rows

    def scatter(self, slots: list[list[int]], rows: HostRows) -> None:
        index = self._index(slots)
        for layer, layer_rows in enumerate(rows):
            self.storage[layer].scatter_rows(index[self.group_of_layer[layer]], layer_rows)

    def copy(self, src: list[list[int]], dst: list[list[int]]) -> None:
        """`RowCopier`: every layer's rows at its group's `src[g]` slots written to the
        `dst[g]` slots, device to device. It goes through `gather_rows` / `scatter_rows`,
        so every buffer moves in the stored form (quantized codes and scales; KIVI key
        groups are taken anew for the copy, as a restore takes them): the copy reads
        back bit-identically from memory of its own."""
        if [len(s) for s in src] != [len(d) for d in dst]:
            raise ValueError(
                f"copying {[len(s) for s in src]} rows per group into {[len(d) for d in dst]}"
            )
        at, to = self._index(src), self._index(dst)
        for layer, storage in enumerate(self.storage):
            g = self.group_of_layer[layer]
            if len(src[g]):
                storage.scatter_rows(to[g], storage.gather_rows(at[g]))  # [n, Hkv, ...] each

    def nbytes(self, counts: list[int]) -> int:
        return sum(
            counts[self.group_of_layer[layer]] * storage.bytes_per_slot()
            for layer, storage in enumerate(self.storage)
        )


def rows_nbytes(rows: HostRows) -> int:
    return sum(t.numel() * t.element_size() for layer in rows for t in layer.values())


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t` (pinned on CUDA when asked; the caller synchronises)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=pin and t.is_cuda)
    return out
