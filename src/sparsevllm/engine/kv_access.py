"""The runner's implementation of `KVAccess`: what sparse methods may do to the KV.

Every eviction goes through `keep` / `keep_per_head`, which also record the logical
position of each kept entry (`ViewPositions`) for pruning and the disk tier. Evictions
change only the pool; its change record brings the device slot tables up to date. Keys
and values are read dequantized from the layer's storage format; per-head compaction
moves stored bytes with their scales (exact in every format).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.kv_seal import KVSealer
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.engine.view_positions import ViewPositions
from sparsevllm.kv.format import KVStorage
from sparsevllm.layers.parallel import SINGLE, HeadShard, TensorParallel
from sparsevllm.sparse.base import HeadRanks
from sparsevllm.upload import upload


class RunnerKV:
    """Reads keys and values through slot tables and applies evictions (freeing slots at once)."""

    def __init__(
        self,
        pool: KVPool,
        storage: list[KVStorage],
        tables: DeviceSlotTables | None = None,
        rows: SlotRows | None = None,
        rope: Callable[[int], torch.Tensor | None] | None = None,
        sealer: KVSealer | None = None,
        tp: TensorParallel = SINGLE,
        heads: HeadShard | None = None,
    ) -> None:
        self.pool = pool
        self.tp = tp  # ranks holding other heads of the same views
        self.heads = heads  # this rank's heads of the model (None: all of them)
        self.sealer = sealer  # told of evictions (a format's residual tail moves)
        self._rope = rope  # the model's rope_frequencies (None: no RoPE known)
        self.tables = tables
        self.rows = rows
        self.storage = storage  # per layer
        self.num_layers = len(storage)
        self.num_kv_heads = storage[0].num_kv_heads
        self.device = storage[0].device
        self.positions = ViewPositions(self.num_kv_heads, self.device)

    def _table(self, seq_id: int, layer: int) -> list[int]:
        return self.pool.table(seq_id, self.pool.group_of_layer[layer])

    def group_of(self, layer: int) -> int:
        return self.pool.group_of_layer[layer]

    def head_ranks(self) -> HeadRanks:
        if self.heads is None or not self.tp.active:
            return HeadRanks(0, self.num_kv_heads, self.num_kv_heads)
        shard, size = self.heads, self.tp.size
        return HeadRanks(
            *shard.kv, shard.num_kv_heads, self.tp.all_reduce, shard.num_kv_heads < size, size
        )

    def rope_frequencies(self, layer: int) -> torch.Tensor | None:
        return None if self._rope is None else self._rope(layer)

    def resident(self, seq_id: int, layer: int) -> int:
        return len(self._table(seq_id, layer))

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def view_slots(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> list[int]:
        return self._table(seq_id, layer)[start:end]

    def gather_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.storage[layer].read_keys(slots)  # [..., Hkv, D]

    def view_tensor(self, seq_id: int, layer: int) -> torch.Tensor:
        """A view's slot ids on the device `[L]`: the slot-table row when it is in sync
        (no host list to convert: views are 32K entries long), else uploaded."""
        group = self.pool.group_of_layer[layer]
        view = self.pool.table(seq_id, group)
        if self.tables is not None and self.rows is not None:
            row = self.rows.get(seq_id)
            if row is not None and self.pool.is_clean(seq_id, group):
                return self.tables.view(group, row, len(view))
        return upload(view, torch.int32, self.device)

    def keys(self, seq_id: int, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        slots = self.view_tensor(seq_id, layer)[start:end].long()
        return self.storage[layer].read_keys(slots)  # [n, Hkv, D]

    def values(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        slots = self.view_tensor(seq_id, layer)[start:end].long()
        return self.storage[layer].read_values(slots)  # [n, Hkv, D]

    def logical_positions(self, seq_id: int, group: int) -> torch.Tensor:
        """`[num_kv_heads, L]`: the token each entry of a group's view holds, per head."""
        return self.positions.positions(seq_id, group, self.pool.num_resident(seq_id, group))

    def forget(self, seq_id: int) -> None:
        self.positions.forget(seq_id)

    def keep(self, seq_id: int, group: int, positions: list[int]) -> None:
        view_len = self.pool.num_resident(seq_id, group)
        self.positions.on_keep(seq_id, group, view_len, positions)
        self.pool.replace_view(seq_id, group, positions)
        if self.sealer is not None:
            self.sealer.on_keep(seq_id, group, view_len, positions)

    def _same_for_all_heads(self, positions: torch.Tensor) -> bool:
        """Whether every KV head keeps the same tokens, heads of other tensor-parallel
        ranks included: every rank must take the same branch (they keep other slots)."""
        first = positions[:1]  # [1, B]
        if self.tp.active:
            first = self.tp.broadcast(first.clone())  # rank 0's first head (a copy)
        return self.tp.min_int(int(bool((positions == first).all()))) == 1

    def keep_per_head(self, seq_id: int, layer: int, positions: torch.Tensor) -> None:
        group = self.pool.group_of_layer[layer]
        if len(self.pool.layer_groups[group]) != 1:
            raise RuntimeError("per-head selection needs one pool group per layer")
        positions = positions.to(self.device)
        if positions.shape[0] != self.num_kv_heads and self.heads is not None:
            # A method over the model's heads (SparseMethod.model_heads): this rank's rows.
            positions = positions[self.heads.kv[0] : self.heads.kv[1]]
        if self._same_for_all_heads(positions):
            self.keep(seq_id, group, positions[0].tolist())  # same tokens for every head
            return
        table = self.view_tensor(seq_id, layer).long()  # [L]
        self.positions.on_keep(seq_id, group, table.shape[0], positions)
        src = table[positions].t()  # [B, Hkv]: head h's j-th token lives in slot src[j, h]
        # The first B slots of the view become the compacted rows; the rest are freed
        # (the device row's first B entries stay as they are).
        n = positions.shape[1]
        self.storage[layer].compact_heads(src, table[:n])
        self.pool.truncate_view(seq_id, group, n)
        if self.sealer is not None:
            self.sealer.on_compact(seq_id, group)
