"""Sealing residual tokens: when a storage format keeps each sequence's newest tokens in
full precision (KIVI's residual, kv/kivi.py), which ones to quantize, and when.

The sealer keeps, per sequence and pool group, how many trailing entries of the view are
residual (`tails`). A step's new tokens join the tail; after the step (and after the
methods' evictions) every tail that holds R + G tokens or more gives its oldest G-token
groups to the layers' storages to seal, so a tail stays between R and R + G - 1 tokens.
A view the prefix store adopts (a finished request's radix prefix or idle chain) is
sealed whole first (`seal_all`): what is cached never holds residual rows, which belong
to running sequences only, and every later reader sees the same codes.

Evictions keep the invariant that the residual entries are the trailing ones: a `keep`
in view order keeps its residual entries at the end; a per-head compaction leaves the
rows whose every head was residual at the end (kv/kivi.py), and the tail is read back.
"""

from __future__ import annotations

import bisect
from functools import partial

import torch

from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.format import GroupsExhausted, KVStorage
from sparsevllm.sparse.base import SeqStep
from sparsevllm.upload import upload

PAD = -1


class KVSealer:
    """Seals the residual tails of the pool groups whose storage keeps one."""

    def __init__(
        self, pool: KVPool, storage: list[KVStorage], group_size: int, residual: int
    ) -> None:
        self.pool = pool
        self.group_size, self.residual = group_size, residual
        self.storages = {
            g: [storage[layer] for layer in pool.layer_groups[g]]
            for g in range(pool.num_main_groups)
            if storage[pool.layer_groups[g][0]].holds_residual
        }
        self.device = storage[0].device
        self.tails: dict[int, list[int]] = {}  # seq_id -> per pool group
        # Every group whose storage keeps state beside its slots hears of freed slots
        # (KIVI's residual rows and key groups, DeltaKV's full rows: kv/format.py).
        # A group may mix formats (radix caching puts sliding layers beside a method's).
        tracking = {
            g: [storage[layer] for layer in pool.layer_groups[g] if storage[layer].tracks_frees]
            for g in range(pool.num_main_groups)
        }
        self.releasers = {g: found for g, found in tracking.items() if found}
        for g in self.releasers:
            pool.on_free(g, partial(self._release, g))

    @property
    def active(self) -> bool:
        return bool(self.storages)

    def _release(self, group: int, slots: list[int]) -> None:
        """The pool freed `slots` of `group`: their residual rows and key groups go back."""
        at = upload(slots, torch.long, self.device)
        for storage in self.releasers[group]:
            storage.release(at)

    def _tails(self, seq_id: int) -> list[int]:
        return self.tails.setdefault(seq_id, [0] * self.pool.num_groups)

    def grow(self, steps: list[SeqStep]) -> None:
        """The step's new tokens joined every view's residual tail."""
        if not self.storages:
            return  # a format without a residual: nothing to track on the hot path
        for step in steps:
            tails = self._tails(step.seq_id)
            for g in self.storages:
                tails[g] += step.num_new

    def seal_due(self, steps: list[SeqStep]) -> None:
        """Seal the oldest whole groups of every tail of R + G tokens or more."""
        if not self.storages:
            return
        g_size, due = self.group_size, self.residual + self.group_size
        batches: dict[int, list[int]] = {g: [] for g in self.storages}
        for step in steps:
            tails = self.tails.get(step.seq_id)
            if tails is None or not self.pool.has(step.seq_id):
                continue
            for g in self.storages:
                if tails[g] >= due:
                    n = (tails[g] - self.residual) // g_size * g_size
                    view = self.pool.table(step.seq_id, g)
                    start = len(view) - tails[g]
                    batches[g].extend(view[start : start + n])
                    tails[g] -= n
        for g, slots in batches.items():
            if slots:
                self._seal(g, slots)

    def seal_all(self, seq_id: int) -> None:
        """Seal every residual entry of `seq_id`'s views (the last group may be short)."""
        tails = self.tails.get(seq_id)
        if tails is None or not self.pool.has(seq_id):
            return
        for g in self.storages:
            view = self.pool.table(seq_id, g)
            tail = min(tails[g], len(view))
            if tail:
                slots = view[len(view) - tail :]
                slots += [PAD] * (-len(slots) % self.group_size)
                self._seal(g, slots)
            tails[g] = 0

    def _seal(self, group: int, slots: list[int]) -> None:
        groups = upload(slots, torch.long, self.device).view(-1, self.group_size)
        for storage in self.storages[group]:
            try:
                storage.seal(groups)
            except GroupsExhausted:
                # Single-token evictions left many groups with few tokens each: re-group
                # the running views once (their keys re-quantized) and seal again.
                self.regroup(group)
                storage.seal(groups)

    def regroup(self, group: int) -> None:
        """Re-quantize the sealed keys of every running view of `group` in new, full
        groups (kv/kivi.py `compact_heads` with every head keeping every entry)."""
        for seq_id in self.tails:
            if self.pool.has(seq_id):
                self._regroup_view(seq_id, group)

    def _regroup_view(self, seq_id: int, group: int) -> None:
        view = upload(self.pool.table(seq_id, group), torch.long, self.device)
        if view.numel():
            for storage in self.storages[group]:
                storage.compact_heads(view[:, None].expand(-1, storage.num_kv_heads), view)

    def on_keep(self, seq_id: int, group: int, old_len: int, positions: list[int]) -> None:
        """A view kept `positions` (of `old_len` entries): its tail is the kept residual
        entries, which stay last when the positions are in view order. An eviction of
        a group's worth of tokens or more re-groups the kept keys (kv/kivi.py): their
        groups would otherwise outlive most of their tokens."""
        tails = self.tails.get(seq_id)
        if tails is None or group not in self.storages:
            return
        if not all(a < b for a, b in zip(positions, positions[1:])):
            self.on_compact(seq_id, group)
            return
        first = old_len - tails[group]
        tails[group] = len(positions) - bisect.bisect_left(positions, first)
        if old_len - len(positions) >= self.group_size and len(positions) > tails[group]:
            self._regroup_view(seq_id, group)

    def on_compact(self, seq_id: int, group: int) -> None:
        """A view was rewritten in place: read its residual tail back from the storage;
        residual entries before it (a keep out of view order) are sealed."""
        tails = self.tails.get(seq_id)
        if tails is None or group not in self.storages:
            return
        view = self.pool.table(seq_id, group)
        tail = self.storages[group][0].residual_tail(upload(view, torch.long, self.device))
        stray = view[: len(view) - tail]
        if stray:
            self._seal(group, stray + [PAD] * (-len(stray) % self.group_size))
        tails[group] = tail

    def forget(self, seq_id: int) -> None:
        self.tails.pop(seq_id, None)
