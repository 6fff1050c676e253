"""The tier stack: host memory, then disk, for the entries of one store (`Tiers`).

An entry offloaded under pressure goes to the host tier (`cpu_offload_gb`); when that is
full, its oldest entries make room: on to the disk tier (`disk_offload_dir`,
`disk_offload_gb`) if there is one, else they are given up (the store forgets them, and
what depends on them). Entries leave a store least recently used first, so the oldest in
the host tier is the least recently used of all. An entry larger than the host tier goes
straight to disk. The disk tier drops its least recently written entries the same way.
Restoring takes the entry out of its tier, asks the store for new slots and copies the
rows back in the same order, so the KV is bit-identical.

The store says what an entry is (`TierClient`: its slots, the tokens and name of its
file, new slots to restore into); the stack moves the bytes (`KVBytes`) and, when an
entry goes to disk, the per-entry device state of `state` (`EntryState`: a chain's view
positions and method state, which the host tier leaves in place).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from sparsevllm.engine.cache.disk_tier import CorruptEntry, DiskTier
from sparsevllm.engine.cache.host_tier import HostTier
from sparsevllm.engine.cache.kv_rows import HostRows, KVBytes, StatePayload
from sparsevllm.engine.cache.store import OffloadUsage
from sparsevllm.engine.cache.tiering import CPU, DISK, SavedEntry, TierClient
from sparsevllm.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)


class EntryState(Protocol):
    """Per-entry device state that travels with an entry to disk, keyed like it."""

    def export(self, key: int) -> StatePayload:
        """The state of entry `key`, as host values (it stays in place)."""

    def load(self, key: int, state: StatePayload) -> None:
        """Take back what `export` returned (possibly in a later engine)."""

    def release(self, key: int) -> None:
        """Free the state of `key` (its disk file holds it now)."""


class TierStack:
    """`Tiers` over a host tier and a disk tier (either may be absent)."""

    def __init__(
        self,
        pool: KVPool,
        kv: KVBytes,
        cpu: HostTier | None,
        disk: DiskTier | None,
        state: EntryState | None = None,
    ) -> None:
        self.pool = pool
        self.kv = kv
        self.cpu = cpu
        self.disk = disk
        self.state = state
        self._client: TierClient | None = None
        # Keys some tier holds, or is moving: an entry the store drops meanwhile leaves
        # this set, which is how a write learns that its entry is gone.
        self._held: set[int] = set()
        self.num_offloaded = 0  # entries moved to a tier (host, or straight to disk)
        self.num_restored = 0
        if disk is not None:
            disk.on_evict = self._disk_evicted

    def bind(self, client: TierClient) -> None:
        self._client = client

    @property
    def client(self) -> TierClient:
        if self._client is None:
            raise RuntimeError("the tier stack serves no store yet (bind one)")
        return self._client

    # -- entries ------------------------------------------------------------------------
    def offload(self, key: int, slots: list[list[int]]) -> str | None:
        counts = [len(s) for s in slots]
        need = self.kv.nbytes(counts)
        if self.cpu is not None and need <= self.cpu.capacity_bytes:
            self._make_cpu_room(need)
            self.cpu.put(key, counts, self.kv.gather(slots, pin=True))
            self._held.add(key)
            self.num_offloaded += 1
            return CPU
        if self.disk is not None:
            self._held.add(key)
            if self._write(key, counts, self.kv.gather(slots, pin=False)):
                self.num_offloaded += 1
                return DISK
            self._held.discard(key)
        return None

    def restore(self, key: int, reserve: int = 0) -> list[list[int]] | None:
        counts = self.counts(key)
        if counts is None:
            return None
        if not self.pool.can_append(max(counts[: self.pool.num_main_groups]) + reserve):
            return None
        try:
            rows, state = self._take(key)
        except CorruptEntry as e:  # never restored: the store forgets the entry
            logger.warning("disk tier: %s; the entry is dropped", e)
            self.drop(key)
            self.client.discard(key)
            return None
        # Out of the tiers before allocating: making room offloads other entries, which
        # may push the oldest ones on or out, and must not take this one.
        self._held.discard(key)
        slots = self.client.allocate(key, counts)
        self.kv.scatter(slots, rows)
        if state is not None and self.state is not None:
            self.state.load(key, state)
        self.num_restored += 1
        return slots

    def _take(self, key: int) -> tuple[HostRows, StatePayload | None]:
        """Remove entry `key` from its tier: its rows, and its state if it was on disk."""
        held = self.cpu.take(key) if self.cpu is not None else None
        if held is not None:
            return held[1], None  # the state stayed in place
        if self.disk is None:
            raise KeyError(f"no tier holds entry {key}")
        rows, state = self.disk.read(key)
        self.disk.drop(key)
        return rows, state

    def drop(self, key: int) -> None:
        self._held.discard(key)
        if self.cpu is not None:
            self.cpu.take(key)
        if self.disk is not None:
            self.disk.drop(key)

    def counts(self, key: int) -> list[int] | None:
        if self.cpu is not None and self.cpu.has(key):
            return self.cpu.counts(key)
        if self.disk is not None and self.disk.has(key):
            return self.disk.counts(key)
        return None

    def nbytes(self, counts: list[int]) -> int:
        return self.kv.nbytes(counts)

    # -- capacity -----------------------------------------------------------------------
    def _make_cpu_room(self, need: int) -> None:
        """Free host bytes for `need`, oldest entries first: on to disk, else given up."""
        cpu = self.cpu
        while cpu is not None and cpu.used_bytes + need > cpu.capacity_bytes:
            oldest = cpu.pop_oldest()
            if oldest is None:
                return
            key, counts, rows = oldest
            if self._write(key, counts, rows):
                self.client.moved(key, DISK)
            elif key in self._held:
                self._held.discard(key)
                self.client.discard(key)

    def _disk_evicted(self, key: int) -> None:
        self._held.discard(key)
        self.client.discard(key)

    def _write(self, key: int, counts: list[int], rows: HostRows) -> bool:
        """Write entry `key` to disk (with its state); False without a disk tier, when it
        does not fit, or when making disk room gave up an entry it depends on (a radix
        node's ancestor), so that it left with it."""
        disk = self.disk
        if disk is None:
            return False
        state = self.state.export(key) if self.state is not None else {}
        if not disk.write(key, self.client.describe(key), counts, rows, state):
            return False
        if key not in self._held:
            disk.drop(key)
            return False
        if self.state is not None:
            self.state.release(key)
        return True

    # -- restarts -----------------------------------------------------------------------
    def scan(self) -> list[SavedEntry]:
        return self.disk.scan() if self.disk is not None else []

    def register(self, key: int, entry: SavedEntry) -> None:
        if self.disk is None:
            raise RuntimeError("no disk tier to register a saved entry in")
        self.disk.register(key, entry)
        self._held.add(key)

    def delete(self, entry: SavedEntry) -> None:
        entry.path.unlink(missing_ok=True)

    def persist(self, evict_all: Callable[[], None]) -> int:
        if self.disk is None:
            return 0
        before = self.disk.num_written
        cpu = self.cpu
        if cpu is not None:
            self._make_cpu_room(cpu.capacity_bytes + 1)  # all of it, oldest first
        self.cpu = None  # so that eviction writes straight to disk
        try:
            evict_all()
        finally:
            self.cpu = cpu
        return self.disk.num_written - before

    def usage(self) -> OffloadUsage:
        cpu, disk = self.cpu, self.disk
        return {
            "cpu_bytes": cpu.used_bytes if cpu is not None else 0,
            "cpu_capacity_bytes": cpu.capacity_bytes if cpu is not None else 0,
            "disk_bytes": disk.used_bytes if disk is not None else 0,
            "disk_capacity_bytes": disk.capacity_bytes if disk is not None else 0,
            "num_offloaded": self.num_offloaded,
            "num_restored": self.num_restored,
        }
