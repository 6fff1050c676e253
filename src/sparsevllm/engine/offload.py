"""CPU offload tier for idle chains: move their KV to host memory instead of dropping it.

When the pool needs room, an idle chain's K/V rows (every layer, in view order) are
copied to CPU tensors (pinned on CUDA) and its slots are freed; the method's own state
stays where it is. When a request continues the chain, new slots are allocated and the
rows are copied back in the same order, so the restored state is bit-identical.
Capacity is `cpu_offload_gb`; when it is full, the disk tier (if any) takes the chain,
else it is dropped as before.
"""

from __future__ import annotations

import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.upload import upload

# A chain's KV off the device: resident rows per group, and per layer (K, V) `[n, Hkv, D]`.
Rows = tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]


def gather_rows(
    pool: KVPool, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], owner: int, pin: bool
) -> Rows:
    """Copy `owner`'s K/V rows to the host, in view order (its slots stay allocated)."""
    counts = [pool.num_resident(owner, g) for g in range(pool.num_groups)]
    index = _group_slots(pool, owner, k_cache[0].device)
    layers_kv = []
    for layer in range(len(k_cache)):
        slots = index[pool.group_of_layer[layer]]
        layers_kv.append((to_host(k_cache[layer][slots], pin), to_host(v_cache[layer][slots], pin)))
    if k_cache[0].is_cuda:
        torch.cuda.synchronize(k_cache[0].device)  # the copies must land before reuse
    return counts, layers_kv


def scatter_rows(
    pool: KVPool, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], owner: int, rows: Rows
) -> None:
    """Give `owner` new slots and copy the rows back in the same order."""
    counts, layers_kv = rows
    pool.append_per_group(owner, counts)
    index = _group_slots(pool, owner, k_cache[0].device)
    for layer, (k, v) in enumerate(layers_kv):
        slots = index[pool.group_of_layer[layer]]
        k_cache[layer][slots] = k.to(k_cache[layer].device)
        v_cache[layer][slots] = v.to(v_cache[layer].device)


def _group_slots(pool: KVPool, owner: int, device: torch.device) -> list[torch.Tensor]:
    """`owner`'s view per group as device slot ids (one conversion per group, not per
    layer: a group may hold every layer)."""
    return [upload(pool.table(owner, g), torch.long, device) for g in range(pool.num_groups)]


def rows_nbytes(rows: Rows) -> int:
    return sum(k.numel() * k.element_size() * 2 for k, _ in rows[1])


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t` (pinned on CUDA when asked; the caller synchronises)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.is_cuda)
    out.copy_(t, non_blocking=pin and t.is_cuda)
    return out


class CpuOffloadStore:
    def __init__(
        self,
        pool: KVPool,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        capacity_bytes: int,
    ) -> None:
        self.pool = pool
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._store: dict[int, Rows] = {}  # owner -> its rows on the host
        self.num_offloaded = 0
        self.num_restored = 0

    def need_bytes(self, owner: int) -> int:
        """Host bytes `owner`'s resident KV would take."""
        counts = [self.pool.num_resident(owner, g) for g in range(self.pool.num_groups)]
        row_bytes = self.k_cache[0][0].numel() * self.k_cache[0].element_size() * 2
        return row_bytes * sum(n * len(g) for n, g in zip(counts, self.pool.layer_groups))

    def oldest(self) -> int | None:
        """The owner offloaded longest ago (None: empty)."""
        return next(iter(self._store), None)

    def offload(self, owner: int) -> bool:
        """Copy `owner`'s KV to the host and free its slots; False if it does not fit."""
        if not self.pool.has(owner):
            return False
        if self.used_bytes + self.need_bytes(owner) > self.capacity_bytes:
            return False
        rows = gather_rows(self.pool, self.k_cache, self.v_cache, owner, pin=True)
        self.pool.release(owner)
        self._store[owner] = rows
        self.used_bytes += rows_nbytes(rows)
        self.num_offloaded += 1
        return True

    def restore(self, owner: int) -> bool:
        """Allocate slots and copy the rows back (in order); False if the pool is full."""
        rows = self._store[owner]
        if not self.pool.can_append(max(rows[0][: self.pool.num_main_groups])):
            return False
        # Out of the store first: making room may offload other chains, and must not
        # move this one on to disk.
        self.drop(owner)
        scatter_rows(self.pool, self.k_cache, self.v_cache, owner, rows)
        self.num_restored += 1
        return True

    def take(self, owner: int) -> Rows | None:
        """Remove and return `owner`'s rows (moving them on to the disk tier)."""
        rows = self._store.get(owner)
        if rows is not None:
            self.drop(owner)
        return rows

    def drop(self, owner: int) -> None:
        rows = self._store.pop(owner, None)
        if rows is not None:
            self.used_bytes -= rows_nbytes(rows)

    def has(self, owner: int) -> bool:
        return owner in self._store
