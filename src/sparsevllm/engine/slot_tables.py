"""Device-resident mirror of the KV pool's slot tables.

The pool (pure Python) is the source of truth. Kernels read a padded int32 table
`[num_groups, num_rows, max_len]` on the device; sequence s uses the row `SlotRows`
gave it and its first `len(view)` entries. Each step applies the plan's `TableWrites`
(the entries the pool recorded as changed, in one scatter) and writes the entries of
views that only grew from the step's slot mapping (`write_new`).
"""

from __future__ import annotations

import torch

from sparsevllm.engine.slot_rows import TableWrites
from sparsevllm.upload import upload


class DeviceSlotTables:
    def __init__(self, num_groups: int, num_rows: int, max_len: int, device: torch.device) -> None:
        self.device = device
        self.max_len = max_len
        # -1 marks unused entries: a kernel that ever read one would fault loudly.
        self.table = torch.full(
            (num_groups, num_rows, max_len), -1, dtype=torch.int32, device=device
        )

    def apply(self, writes: TableWrites) -> None:
        """Upload the entries a step plan lists, in one scatter."""
        if writes.values:
            index = upload(writes.index, torch.long, self.device)
            values = upload(writes.values, torch.int32, self.device)
            self.table.view(-1).index_copy_(0, index, values)

    def write_new(
        self,
        rows: torch.Tensor,  # [S] table row of each sequence
        view_lens: torch.Tensor,  # [G, S] view lengths after the step
        slots: torch.Tensor,  # [G, T] slot of each new token per group, sequence-major
        q_starts: torch.Tensor | None = None,  # [S + 1] first token of each sequence, then T
    ) -> None:
        """Write every sequence's new entries per group from the step's slot mapping (for
        the plan's deferred sequences; the others' rows get the same values): the last n_s
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

    def view(self, group: int, row: int, n: int) -> torch.Tensor:
        """The first `n` entries of a row: a view's slot ids `[n]` int32 (when the pool
        says the row holds all of them)."""
        return self.table[group, row, :n]
