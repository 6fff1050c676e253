"""The runner's implementation of `KVAccess`: what sparse methods may do to the KV."""

from __future__ import annotations

import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.slot_tables import DeviceSlotTables


class RunnerKV:
    """Reads keys through slot tables and applies evictions (freeing slots at once)."""

    def __init__(
        self,
        pool: KVPool,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        tables: DeviceSlotTables | None = None,
    ) -> None:
        self.pool = pool
        self.tables = tables
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.num_layers = len(k_cache)
        self.num_kv_heads = k_cache[0].shape[1]
        self.device = k_cache[0].device

    def _table(self, seq_id: int, layer: int) -> list[int]:
        return self.pool.table(seq_id, self.pool.group_of_layer[layer])

    def group_of(self, layer: int) -> int:
        return self.pool.group_of_layer[layer]

    def resident(self, seq_id: int, layer: int) -> int:
        return len(self._table(seq_id, layer))

    def keys(self, seq_id: int, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        slots = torch.tensor(self._table(seq_id, layer)[start:end], device=self.device)
        return self.k_cache[layer][slots]  # [n, Hkv, D]

    def keep(self, seq_id: int, group: int, positions: list[int]) -> None:
        self.pool.replace_view(seq_id, group, positions)
        if self.tables is not None:
            self.tables.rewrite(seq_id, group)

    def keep_per_head(self, seq_id: int, layer: int, positions: torch.Tensor) -> None:
        group = self.pool.group_of_layer[layer]
        if len(self.pool.layer_groups[group]) != 1:
            raise RuntimeError("per-head selection needs one pool group per layer")
        positions = positions.to(self.device)
        if bool((positions == positions[:1]).all()):
            self.keep(seq_id, group, positions[0].tolist())  # same tokens for every head
            return
        table = torch.tensor(self._table(seq_id, layer), device=self.device)
        heads = torch.arange(positions.shape[0], device=self.device)
        src = table[positions].t()  # [B, Hkv]: head h's j-th token lives in slot src[j, h]
        k_new = self.k_cache[layer][src, heads]  # [B, Hkv, D] (a copy)
        v_new = self.v_cache[layer][src, heads]
        # The first B slots of the view become the compacted rows; the rest are freed.
        dst = table[: positions.shape[1]]
        self.k_cache[layer][dst] = k_new
        self.v_cache[layer][dst] = v_new
        self.keep(seq_id, group, list(range(positions.shape[1])))
