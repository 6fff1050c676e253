"""CPU offload tier for idle chains: move their KV to host memory instead of dropping it.

When the pool needs room, an idle chain's K/V rows (every layer, in view order) are
copied to CPU tensors (pinned on CUDA) and its slots are freed; the method's own state
stays where it is. When a request continues the chain, new slots are allocated and the
rows are copied back in the same order, so the restored state is bit-identical.
Capacity is `cpu_offload_gb`; when it is full, the chain is dropped as before.
"""

from __future__ import annotations

import torch

from sparsevllm.engine.kv_pool import KVPool


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
        # owner -> (rows per group, per layer (k, v) on the host)
        self._store: dict[int, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.num_offloaded = 0
        self.num_restored = 0

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        out.copy_(t, non_blocking=t.is_cuda)
        return out

    def offload(self, owner: int) -> bool:
        """Copy `owner`'s KV to the host and free its slots; False if it does not fit."""
        if not self.pool.has(owner):
            return False
        counts = [self.pool.num_resident(owner, g) for g in range(self.pool.num_groups)]
        row_bytes = self.k_cache[0][0].numel() * self.k_cache[0].element_size() * 2
        need = sum(counts[g] * len(layers) for g, layers in enumerate(self.pool.layer_groups))
        if self.used_bytes + need * row_bytes > self.capacity_bytes:
            return False
        layers_kv = []
        for layer in range(len(self.k_cache)):
            g = self.pool.group_of_layer[layer]
            slots = torch.tensor(self.pool.table(owner, g), device=self.k_cache[layer].device)
            layers_kv.append(
                (self._host(self.k_cache[layer][slots]), self._host(self.v_cache[layer][slots]))
            )
        if self.k_cache[0].is_cuda:
            torch.cuda.synchronize(self.k_cache[0].device)  # the copies must land before reuse
        self.pool.release(owner)
        self._store[owner] = (counts, layers_kv)
        self.used_bytes += need * row_bytes
        self.num_offloaded += 1
        return True

    def restore(self, owner: int) -> bool:
        """Allocate slots and copy the rows back (in order); False if the pool is full."""
        counts, layers_kv = self._store[owner]
        if not self.pool.can_append(max(counts[: self.pool.num_main_groups])):
            return False
        self.pool.append_per_group(owner, counts)
        for layer, (k, v) in enumerate(layers_kv):
            g = self.pool.group_of_layer[layer]
            slots = torch.tensor(self.pool.table(owner, g), device=self.k_cache[layer].device)
            self.k_cache[layer][slots] = k.to(self.k_cache[layer].device)
            self.v_cache[layer][slots] = v.to(self.v_cache[layer].device)
        self.drop(owner)
        self.num_restored += 1
        return True

    def drop(self, owner: int) -> None:
        entry = self._store.pop(owner, None)
        if entry is not None:
            self.used_bytes -= sum(k.numel() * k.element_size() * 2 for k, _ in entry[1])

    def has(self, owner: int) -> bool:
        return owner in self._store
