"""Device-resident mirror of the KV pool's slot tables.

The pool (pure Python) is the source of truth. Kernels read a padded int32 table
`[num_groups, num_rows, max_len]` on the device; sequence s uses row `row_of[s]` and
its first `len(view)` entries. Each step only the new entries are uploaded (one
scatter for the whole batch); an eviction rewrites the affected row.
"""

from __future__ import annotations

import torch

from sparsevllm.engine.kv_pool import KVPool


class DeviceSlotTables:
    def __init__(self, pool: KVPool, num_rows: int, max_len: int, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self.max_len = max_len
        # -1 marks unused entries: a kernel that ever read one would fault loudly.
        self.table = torch.full(
            (pool.num_groups, num_rows, max_len), -1, dtype=torch.int32, device=device
        )
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.row_of: dict[int, int] = {}
        self._synced: dict[int, list[int]] = {}  # seq_id -> per-group entries uploaded

    def row(self, seq_id: int) -> int:
        if seq_id not in self.row_of:
            if not self._free_rows:
                raise RuntimeError("no free slot-table row (more sequences than max_num_seqs)")
            self.row_of[seq_id] = self._free_rows.pop()
            self._synced[seq_id] = [0] * self.pool.num_groups
        return self.row_of[seq_id]

    def reserve_row(self, row: int) -> None:
        """Take a row out of circulation (the CUDA-graph padding row)."""
        self._free_rows.remove(row)

    def sync(self, seq_ids: list[int]) -> None:
        """Upload the entries the pool appended since the last sync, in one scatter."""
        flat_index: list[int] = []
        values: list[int] = []
        rows_per_group = self.table.shape[1] * self.max_len
        for seq_id in seq_ids:
            row = self.row(seq_id)
            synced = self._synced[seq_id]
            for g in range(self.pool.num_groups):
                table = self.pool.table(seq_id, g)
                if len(table) < synced[g]:
                    raise RuntimeError("slot table shrank without a rewrite")
                base = g * rows_per_group + row * self.max_len
                flat_index.extend(range(base + synced[g], base + len(table)))
                values.extend(table[synced[g] :])
                synced[g] = len(table)
        if values:
            index = _upload(flat_index, torch.long, self.device)
            self.table.view(-1).index_copy_(0, index, _upload(values, torch.int32, self.device))

    def rewrite(self, seq_id: int, group: int) -> None:
        """Replace a row after an eviction changed the view."""
        view = self.pool.table(seq_id, group)
        row = self.row(seq_id)
        if view:
            self.table[group, row, : len(view)] = _upload(view, torch.int32, self.device)
        self._synced[seq_id][group] = len(view)

    def invalidate(self, seq_id: int, group: int) -> None:
        """The pool rewrote a view (a sliding-window trim): upload all of it next sync,
        in the same scatter as the other sequences' new entries."""
        if seq_id in self._synced:
            self._synced[seq_id][group] = 0

    def release(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._synced.pop(seq_id, None)


def _upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
