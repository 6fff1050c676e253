"""Device-resident mirror of the KV pool's slot tables.

The pool (pure Python) is the source of truth. Kernels read a padded int32 table
`[num_groups, num_rows, max_len]` on the device; sequence s uses row `row_of[s]` and
its first `len(view)` entries. Each step only the new entries are uploaded (one
scatter for the whole batch); an eviction rewrites the affected row.
"""

from __future__ import annotations

import operator

import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.upload import upload


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

    def sync(
        self,
        seq_ids: list[int],
        lens_by_seq: list[list[int]] | None = None,
        num_new: list[int] | None = None,
    ) -> list[int]:
        """Upload the entries the pool appended since the last sync, in one scatter.

        With `lens_by_seq` (each sequence's current view length per group, as the caller
        computed them anyway), sequences whose every view grew by exactly their step's
        new tokens (`num_new`, default one: a decode step) are left out of the upload:
        their indices into `seq_ids` are returned, and the caller writes those entries
        on the device from the slot mapping it uploads anyway (`write_new`)."""
        flat_index: list[int] = []
        values: list[int] = []
        deferred: list[int] = []
        group_stride = self.table.shape[1] * self.max_len
        num_groups = self.pool.num_groups
        # Runs for num_seqs x num_groups views per step (one group per layer for
        # eviction methods), so the common case (every view grew by the step's tokens,
        # written by the device) is decided with C-level map()s, not a loop per group.
        for i, seq_id in enumerate(seq_ids):
            row_base = self.row(seq_id) * self.max_len
            synced = self._synced[seq_id]
            tables = self.pool.tables[seq_id]
            lens = list(map(len, tables)) if lens_by_seq is None else lens_by_seq[i]
            grew = list(map(operator.sub, lens, synced))
            # The row's first `synced` entries are right, so a view that grew by exactly
            # the step's new tokens is complete once the device writes those.
            if lens_by_seq is not None and grew.count(num_new[i] if num_new else 1) == num_groups:
                deferred.append(i)
            elif any(grew):
                if min(grew) < 0:
                    raise RuntimeError("slot table shrank without a rewrite")
                for g, (table, done, n) in enumerate(zip(tables, synced, lens)):
                    base = g * group_stride + row_base
                    flat_index.extend(range(base + done, base + n))
                    values.extend(table[done:])
            self._synced[seq_id] = lens
        if values:
            index = upload(flat_index, torch.long, self.device)
            self.table.view(-1).index_copy_(0, index, upload(values, torch.int32, self.device))
        return deferred

    def write_new(
        self,
        rows: torch.Tensor,  # [S] table row of each sequence
        view_lens: torch.Tensor,  # [G, S] view lengths after the step
        slots: torch.Tensor,  # [G, T] slot of each new token per group, sequence-major
        q_starts: torch.Tensor | None = None,  # [S + 1] first token of each sequence, then T
    ) -> None:
        """Write every sequence's new entries per group from the step's slot mapping (for
        `sync`'s deferred sequences; the others' rows get the same values): the last n_s
        entries of sequence s's view are the slots of its n_s new tokens. One scatter.
        `q_starts=None`: one new token per sequence (a decode step, T = S)."""
        groups = torch.arange(slots.shape[0], device=rows.device).unsqueeze(1)  # [G, 1]
        if q_starts is None:
            self.table[groups, rows.long().unsqueeze(0), view_lens.long() - 1] = slots.int()
            return
        num_seqs, num_tokens = rows.shape[0], slots.shape[1]
        ends = q_starts[1:]  # [S]
        seq = torch.repeat_interleave(
            torch.arange(num_seqs, device=rows.device), ends - q_starts[:-1], output_size=num_tokens
        )  # [T] the sequence of each token
        token = torch.arange(num_tokens, device=rows.device)
        pos = view_lens[:, seq] - (ends[seq] - token)  # [G, T] view position of each token
        self.table[groups, rows[seq].long().unsqueeze(0), pos.long()] = slots.int()

    def rewrite(self, seq_id: int, group: int) -> None:
        """Replace a row after an eviction changed the view."""
        view = self.pool.table(seq_id, group)
        row = self.row(seq_id)
        if view:
            self.table[group, row, : len(view)] = upload(view, torch.int32, self.device)
        self._synced[seq_id][group] = len(view)

    def synced_view(self, seq_id: int, group: int) -> torch.Tensor | None:
        """A sequence's view in a group as device slot ids `[L]` int32, when the device
        row holds all of it (else None: entries not uploaded yet)."""
        if seq_id not in self.row_of:
            return None
        n = len(self.pool.table(seq_id, group))
        if self._synced[seq_id][group] != n:
            return None
        return self.table[group, self.row_of[seq_id], :n]

    def truncate(self, seq_id: int, group: int, n: int) -> None:
        """The pool kept a view's first `n` entries (`KVPool.truncate_view`): the row's
        prefix is already right, only the synced length changes."""
        if seq_id in self._synced:
            self._synced[seq_id][group] = min(n, self._synced[seq_id][group])

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
