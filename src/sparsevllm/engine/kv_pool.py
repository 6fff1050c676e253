"""Token-granular KV slot pool (page size 1) and per-layer request->slot tables.

The pool never touches tensors: it hands out integer slot ids, and the runner's
per-layer K/V tensors `[num_slots, num_kv_heads, head_dim]` are indexed by them.

Layers are organised in *groups*. All layers of a group share one allocator and one
slot table per sequence, so a dense method (every layer keeps every token) pays for
one table, while a method that keeps different tokens per layer uses one group per
layer. Each layer still owns its own K/V tensor of `num_slots` rows, so the slot id
`s` of a group addresses row `s` of each of its layers' tensors.

Sliding-window layers (Gemma 3's local layers) live in *window groups* after the main
ones: a query there never reads further back than its window, so after every step
`trim` cuts such a group's view to the newest `window - 1` entries and frees the rest.
A window group has its own slot count, sized by the host so that the running batch
always fits (`CapacityPlan.window_slots`); it never limits admission, and the counters that
admission and reports use (`num_free`, `num_used`, `peak_used`) cover the main groups.

The pool also records its own changes for the one consumer that mirrors its views (the
device slot tables): per sequence and group, how many leading entries are unchanged
since that consumer last synced (`clean_prefix` / `mark_clean`). Appends keep the
prefix; every other mutator (an eviction, a window trim, a dropped step) lowers it, so
the mirror re-uploads exactly what changed and nobody invalidates it by hand.
"""

from __future__ import annotations

import collections
import itertools
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Reclaimer(Protocol):
    """Cached state holding pool slots that the pool may take back (the prefix store)."""

    @property
    def reclaimable_slots(self) -> int:
        """Slots `make_room` could free now."""

    def make_room(self, n: int) -> None:
        """Free at least `n` slots (if possible) through the pool."""


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


def shuffle_seed(order: str, seed: int) -> int | None:
    """KVPool's `shuffle_seed` for EngineConfig.kv_slot_order."""
    return seed if order == "shuffled" else None


class _GroupAllocator:
    """A free list of slot ids for one layer group, with used/peak counters."""

    def __init__(self, num_slots: int, shuffle_seed: int | None = None) -> None:
        self.num_slots = num_slots
        # Popping from the end hands out low ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        if shuffle_seed is not None:  # see EngineConfig.kv_slot_order
            random.Random(shuffle_seed).shuffle(self._free)
        self.peak_used = 0
        # Told of every slot freed (a storage keeping state beside its rows drops it).
        self.on_free: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} slots, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))
        if self.on_free is not None and slots:
            self.on_free(slots)


@dataclass(frozen=True)
class WindowGroup:
    """Sliding-window layers sharing one window: each keeps its last `window - 1` tokens
    between steps, in a group of its own `num_slots`."""

    layers: list[int]
    window: int
    num_slots: int


class KVPool:
    """Slot allocator plus, per sequence and layer group, the ordered slot table."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        layer_groups: list[list[int]],
        window_groups: list[WindowGroup] | None = None,
        shuffle_seed: int | None = None,
    ) -> None:
        """`shuffle_seed`: hand out free slots in a seeded random order instead of
        ascending ids (views then spread over the whole pool's memory)."""
        if num_slots <= 0:
            raise ValueError(f"the KV pool needs at least one slot, got {num_slots}")
        window_groups = window_groups or []
        all_groups = [list(g) for g in layer_groups] + [list(w.layers) for w in window_groups]
        covered = sorted(layer for group in all_groups for layer in group)
        if covered != list(range(num_layers)):
            raise ValueError(f"layer groups {all_groups} must cover layers 0..{num_layers - 1}")
        if any(w.window < 1 or w.num_slots < 1 for w in window_groups):
            raise ValueError("a window group needs a window and slots >= 1")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.layer_groups = all_groups
        self.num_main_groups = len(layer_groups)
        # group index -> window, for the window groups (after the main groups)
        self.windows = {len(layer_groups) + i: w.window for i, w in enumerate(window_groups)}
        self.group_of_layer = [0] * num_layers
        for gi, group in enumerate(all_groups):
            for layer in group:
                self.group_of_layer[layer] = gi
        self._alloc = [_GroupAllocator(num_slots, shuffle_seed) for _ in layer_groups] + [
            _GroupAllocator(w.num_slots, shuffle_seed) for w in window_groups
        ]
        self._main = self._alloc[: self.num_main_groups]
        # seq_id -> per-group ordered slot list (the sequence's physical view).
        self.tables: dict[int, list[list[int]]] = {}
        # Prefix caching (one group only): leading slots a sequence borrows from the
        # cache. Cached state (radix nodes, idle chains) stays allocated; the reclaimer
        # gives it back under pressure (`reclaimable_slots`, `make_room(n)` freeing
        # through this pool).
        self._borrowed: dict[int, int] = {}
        self.reclaimer: Reclaimer | None = None
        # seq_id -> per group: leading view entries unchanged since the consumer synced.
        self._clean: dict[int, list[int]] = {}

    # -- counters ---------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.layer_groups)

    @property
    def num_free(self) -> int:
        """Free slots of the fullest group: what a new token can count on in every layer."""
        return min(a.num_free for a in self._main)

    def num_free_in(self, group: int) -> int:
        """Free slots of one main group."""
        return self._main[group].num_free

    @property
    def num_used(self) -> int:
        return max(a.num_used for a in self._main)

    @property
    def peak_used(self) -> int:
        return max(a.peak_used for a in self._main)

    def used_per_layer(self) -> list[int]:
        return [
            self._alloc[self.group_of_layer[layer]].num_used for layer in range(self.num_layers)
        ]

    def peak_used_per_layer(self) -> list[int]:
        """The most slots each layer's group has held at once since the last reset (a step
        allocates before its method evicts: the peak includes the step's new tokens)."""
        return [
            self._alloc[self.group_of_layer[layer]].peak_used for layer in range(self.num_layers)
        ]

    def reset_peak(self) -> None:
        for a in self._alloc:
            a.peak_used = a.num_used

    def on_free(self, group: int, callback: Callable[[list[int]], None]) -> None:
        """Call `callback(slots)` whenever slots of `group` return to the free list."""
        self._alloc[group].on_free = callback

    # -- the change record ------------------------------------------------------------
    def clean_prefix(self, seq_id: int) -> list[int]:
        """Per group, how many leading entries of `seq_id`'s view are unchanged since the
        last `mark_clean` (entries past them are new or were rewritten)."""
        return self._clean[seq_id]

    def mark_clean(self, seq_id: int, lens: list[int]) -> None:
        """The consumer's copy of `seq_id`'s views now holds their first `lens[g]` entries
        (its current lengths after an upload; zeros for a copy that must start over)."""
        self._clean[seq_id] = lens

    def is_clean(self, seq_id: int, group: int) -> bool:
        """The consumer's copy of this view is whole."""
        clean = self._clean.get(seq_id)
        return clean is not None and clean[group] == len(self.tables[seq_id][group])

    def _changed(self, seq_id: int, group: int, keep: int) -> None:
        """Only the first `keep` entries of a view are still as the consumer saw them."""
        clean = self._clean[seq_id]
        if clean[group] > keep:
            clean[group] = keep

    def _new_view(self, seq_id: int, views: list[list[int]]) -> None:
        self.tables[seq_id] = views
        self._clean[seq_id] = [0] * len(views)

    # -- per-sequence tables ----------------------------------------------------------
    def has(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def table(self, seq_id: int, group: int = 0) -> list[int]:
        return self.tables[seq_id][group]

    def num_resident(self, seq_id: int, group: int = 0) -> int:
        tables = self.tables.get(seq_id)
        return len(tables[group]) if tables else 0

    def resident(self, seq_id: int) -> int:
        """Most slots `seq_id` holds in any main group (what it costs admission)."""
        return max(self.num_resident(seq_id, g) for g in range(self.num_main_groups))

    @property
    def num_available(self) -> int:
        """Free slots plus cached slots that could be evicted for new work."""
        return self.num_free + (self.reclaimer.reclaimable_slots if self.reclaimer else 0)

    def can_append(self, n: int) -> bool:
        return n <= self.num_available

    def append(self, seq_id: int, n: int) -> list[list[int]]:
        """Give `seq_id` `n` new slots at the end of its view in every group.

        Returns the new slots per group. Either all groups get their slots or none do.
        """
        if n > self.num_free and self.reclaimer is not None:
            self.reclaimer.make_room(n - self.num_free)
        if n > self.num_free:
            raise PoolExhausted(f"sequence {seq_id} needs {n} slots, {self.num_free} free")
        self._window_room(seq_id, [n] * self.num_groups)
        if seq_id not in self.tables:
            self._new_view(seq_id, [[] for _ in self.layer_groups])
        tables = self.tables[seq_id]
        new = [a.allocate(n) for a in self._alloc]
        for table, slots in zip(tables, new):
            table.extend(slots)
        return new

    def append_batch(self, seq_ids: list[int], counts: list[int]) -> bool:
        """`append(seq_ids[i], counts[i])` for every i at once, if the free slots cover
        them all without reclaiming cached state; returns False (nothing done) if not.

        A decode step appends to every group of every running sequence: one slice of
        each group's free list instead of one allocation per sequence and group.
        """
        total = sum(counts)
        if any(total > a.num_free for a in self._alloc) or not all(
            s in self.tables for s in seq_ids
        ):
            return False
        ends = list(itertools.accumulate(counts))
        starts = [e - c for e, c in zip(ends, counts)]
        single = all(c == 1 for c in counts)
        views = [self.tables[s] for s in seq_ids]
        for g, alloc in enumerate(self._alloc):
            slots = alloc.allocate(total)
            tables = map(operator.itemgetter(g), views)
            if single:  # C-level: this runs num_seqs x num_groups times per decode step
                collections.deque(map(list.append, tables, slots), maxlen=0)
            else:
                for table, a, b in zip(tables, starts, ends):
                    table.extend(slots[a:b])
        return True

    def drop_last(self, seq_id: int, n: int = 1) -> None:
        """Free the newest `n` entries of every group of `seq_id`'s view (a step scheduled
        ahead for a sequence that finished before it: its token is not kept)."""
        for g, (alloc, table) in enumerate(zip(self._alloc, self.tables[seq_id])):
            alloc.free(table[-n:])
            del table[-n:]
            self._changed(seq_id, g, len(table))

    def append_per_group(self, seq_id: int, counts: list[int]) -> None:
        """Give a new view `counts[g]` slots in group g (restoring offloaded state)."""
        if seq_id in self.tables:
            raise RuntimeError(f"sequence {seq_id} already has slots")
        main = max(counts[: self.num_main_groups])
        if main > self.num_free and self.reclaimer is not None:
            self.reclaimer.make_room(main - self.num_free)
        self._window_room(seq_id, counts)
        if any(n > a.num_free for n, a in zip(counts, self._alloc)):
            raise PoolExhausted(f"sequence {seq_id} needs {counts} slots")
        self._new_view(seq_id, [a.allocate(n) for n, a in zip(counts, self._alloc)])

    def _window_room(self, seq_id: int, counts: list[int]) -> None:
        """Make room in the window groups; only idle cached state can crowd them (the
        running batch fits by their sizing), so reclaim it until the request fits."""
        for g in self.windows:
            alloc = self._alloc[g]
            while counts[g] > alloc.num_free and self.reclaimer is not None:
                if self.reclaimer.reclaimable_slots == 0:
                    break
                self.reclaimer.make_room(1)
            if counts[g] > alloc.num_free:
                raise PoolExhausted(
                    f"sequence {seq_id} needs {counts[g]} slots in the sliding-window group "
                    f"{g}, {alloc.num_free} free of {alloc.num_slots}"
                )

    def trim(self, seq_id: int) -> list[int]:
        """Cut every window group's view of `seq_id` to its newest window - 1 entries,
        freeing the rest; returns the groups whose view changed."""
        tables = self.tables.get(seq_id)
        changed = []
        for g, window in self.windows.items():
            table = tables[g] if tables else []
            drop = len(table) - (window - 1)
            if drop > 0:
                self._alloc[g].free(table[:drop])
                del table[:drop]
                self._changed(seq_id, g, 0)  # every entry moved forward
                changed.append(g)
        return changed

    def release(self, seq_id: int) -> None:
        """Free every slot `seq_id` owns (finish, abort or preemption); borrowed
        prefix slots stay with the cache."""
        tables = self.tables.pop(seq_id, None)
        borrowed = self._borrowed.pop(seq_id, 0)
        self._clean.pop(seq_id, None)
        if tables is None:
            return
        for alloc, table in zip(self._alloc, tables):
            alloc.free(table[borrowed:])

    def attach(self, seq_id: int, slots: list[int]) -> None:
        """Start `seq_id`'s view with slots borrowed from the prefix cache."""
        if self.num_groups != 1:
            raise RuntimeError("prefix sharing needs a single layer group")
        self._new_view(seq_id, [list(slots)])
        self._borrowed[seq_id] = len(slots)

    def detach(self, seq_id: int) -> list[int]:
        """Take `seq_id`'s view out of the pool without freeing it (the cache adopts it)."""
        self._borrowed.pop(seq_id, None)
        self._clean.pop(seq_id, None)
        return self.tables.pop(seq_id)[0]

    def free_slots(self, slots: list[int]) -> None:
        self._alloc[0].free(slots)

    def take_slots(self, n: int) -> list[int]:
        """`n` slots outside any sequence's table, for the prefix cache (restoring an
        offloaded radix node); other cached state is reclaimed first if needed."""
        if self.num_groups != 1:
            raise RuntimeError("prefix sharing needs a single layer group")
        if n > self.num_free and self.reclaimer is not None:
            self.reclaimer.make_room(n - self.num_free)
        return self._alloc[0].allocate(n)

    def truncate_view(self, seq_id: int, group: int, n: int) -> None:
        """Keep the first `n` slots of a group's view; the rest return to the pool."""
        table = self.tables[seq_id][group]
        self.tables[seq_id][group] = table[:n]
        self._alloc[group].free(table[n:])
        self._changed(seq_id, group, n)

    def replace_view(self, seq_id: int, group: int, keep: list[int]) -> list[int]:
        """Keep only the slots at positions `keep` (in that order) of a group's view.

        The dropped slots return to the pool at once. Returns the dropped slot ids.
        """
        table = self.tables[seq_id][group]
        kept = [table[i] for i in keep]
        kept_set = set(kept)
        if len(kept_set) != len(kept):
            raise ValueError("replace_view: duplicate positions in keep")
        dropped = [s for s in table if s not in kept_set]
        self.tables[seq_id][group] = kept
        self._alloc[group].free(dropped)
        # Entries before the first moved one stay where the consumer has them.
        same = next((i for i, p in enumerate(keep) if p != i), len(keep))
        self._changed(seq_id, group, same)
        return dropped
