"""The logical position of every view entry of a sequence whose KV was evicted.

A slot table lists the slots a sequence reads, not which token each slot holds. Once an
eviction method compacts a view (per KV head, possibly differently for every head), the
mapping is lost, yet pruning a logical range of an idle chain ("tokens 120-480 were an
old tool output") and restoring a chain saved by an earlier engine both need it.

The record is kept lazily, so decode steps that evict nothing pay nothing: for each
(sequence, layer group) it holds the positions of the first K view entries as of the
last eviction (`[num_kv_heads, K]`) and the position of view entry K; the entries
appended since then are consecutive tokens. A view that was never evicted has no record:
entry j holds token j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Record:
    kept: torch.Tensor  # [Hkv, K] int32: logical position of each entry kept by the last eviction
    next_pos: int  # logical position of view entry K (later entries count on from it)


class ViewPositions:
    def __init__(self, num_kv_heads: int, device: torch.device) -> None:
        self.num_kv_heads = num_kv_heads
        self.device = device
        self._records: dict[int, dict[int, _Record]] = {}  # seq_id -> group -> record

    def positions(self, seq_id: int, group: int, view_len: int) -> torch.Tensor:
        """`[num_kv_heads, view_len]` int32: the token each view entry holds, per head."""
        rec = self._records.get(seq_id, {}).get(group)
        known = 0 if rec is None else rec.kept.shape[1]
        start = 0 if rec is None else rec.next_pos
        tail = torch.arange(start, start + view_len - known, dtype=torch.int32, device=self.device)
        tail = tail.expand(self.num_kv_heads, -1)
        return tail if rec is None else torch.cat([rec.kept, tail], dim=1)

    def on_keep(
        self, seq_id: int, group: int, view_len: int, keep: list[int] | torch.Tensor
    ) -> None:
        """A view of `view_len` entries keeps `keep`: `[B]` for every head or `[Hkv, B]`."""
        full = self.positions(seq_id, group, view_len)
        rec = self._records.get(seq_id, {}).get(group)
        next_pos = view_len if rec is None else rec.next_pos + view_len - rec.kept.shape[1]
        index = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        if index.dim() == 1:
            index = index.expand(self.num_kv_heads, -1)
        self._records.setdefault(seq_id, {})[group] = _Record(full.gather(1, index), next_pos)

    def forget(self, seq_id: int) -> None:
        self._records.pop(seq_id, None)

    def copy(self, src: int, dst: int) -> None:
        """Give `dst` the records of `src`, in tensors of its own (a copied chain)."""
        records = self._records.get(src)
        if records:
            self._records[dst] = {
                g: _Record(rec.kept.clone(), rec.next_pos) for g, rec in records.items()
            }

    # -- persistence (the disk tier) ----------------------------------------------------
    def export(self, seq_id: int, num_groups: int) -> list[tuple[torch.Tensor, int] | None]:
        """Per group: (kept positions on the host, next position), or None (no record)."""
        out: list[tuple[torch.Tensor, int] | None] = []
        records = self._records.get(seq_id, {})
        for g in range(num_groups):
            rec = records.get(g)
            out.append(None if rec is None else (rec.kept.cpu(), rec.next_pos))
        return out

    def load(self, seq_id: int, records: list[tuple[torch.Tensor, int] | None]) -> None:
        for g, rec in enumerate(records):
            if rec is not None:
                kept, next_pos = rec
                kept = kept.to(self.device, torch.int32)
                self._records.setdefault(seq_id, {})[g] = _Record(kept, int(next_pos))
