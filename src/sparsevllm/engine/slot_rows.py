"""The host side of the device slot tables (torch-free): which row each sequence uses,
and the entries a step writes (`TableWrites`).

The rows live on the host with the step plan (`step_plan.py`): the runner never decides
which row is whose. A row newly given to a sequence starts empty on the device, so the
pool's change record for that sequence is reset and its next plan uploads every entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsevllm.engine.kv_pool import KVPool


class SlotRows:
    """Which row of the device slot tables `[G, num_rows, max_len]` each sequence uses."""

    def __init__(self, pool: KVPool, num_rows: int, max_len: int) -> None:
        self.pool = pool
        self.num_rows = num_rows
        self.max_len = max_len
        self._free = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}

    def row(self, seq_id: int) -> int:
        """`seq_id`'s row, assigned on first use (its entries are then all uploaded)."""
        row = self._row_of.get(seq_id)
        if row is None:
            if not self._free:
                raise RuntimeError("no free slot-table row (more sequences than max_num_seqs)")
            row = self._row_of[seq_id] = self._free.pop()
            self.pool.mark_clean(seq_id, [0] * self.pool.num_groups)
        return row

    def get(self, seq_id: int) -> int | None:
        """`seq_id`'s row if it has one (an idle chain or a waiting request has none)."""
        return self._row_of.get(seq_id)

    def reserve(self, row: int) -> None:
        """Take a row out of circulation (the CUDA-graph padding row)."""
        self._free.remove(row)

    def release(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free.append(row)


@dataclass(frozen=True)
class TableWrites:
    """Slot-table entries to upload: flat indices into `[G, num_rows, max_len]` and their
    slot ids; `deferred` lists the sequences (plan indices) whose new entries the device
    writes from the step's slot mapping instead."""

    index: list[int]
    values: list[int]
    deferred: list[int]
