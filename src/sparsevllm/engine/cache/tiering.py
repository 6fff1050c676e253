"""The contract between a store and the tier stack (host memory, then disk).

The stack (`tier_stack.TierStack`) moves bytes: it copies an entry's KV rows off the
pool and back, keeps them within byte caps, writes and reads disk files. The store says
what an entry is: the slots it holds per pool group, and for a disk file its logical
tokens, a name and its own metadata (`TierClient`). An entry is named by an integer
key the store chooses (a chain's owner sequence id, a radix node's key).

Pure Python: a store holds a `Tiers` without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sparsevllm.engine.cache.store import OffloadUsage

CPU = "CPU"
DISK = "disk"


@dataclass(frozen=True)
class DiskRecord:
    """What a disk file records about an entry besides its KV rows."""

    # Names the file: writing the same name again replaces it (a chain id); a store
    # whose entries have no stable name passes a unique one.
    name: str
    tokens: list[int]  # the logical tokens the entry stands for
    meta: dict[str, object] = field(default_factory=dict)  # the store's own, JSON


@dataclass(frozen=True)
class SavedEntry:
    """An entry an earlier engine left in the disk tier, found at start."""

    path: Path
    nbytes: int
    name: str
    tokens: list[int]
    counts: list[int]  # rows per pool group
    saved_at: float
    meta: dict[str, object]  # the store's own metadata, as written


class TierClient(Protocol):
    """What the stack asks of the store whose entries it holds."""

    def describe(self, key: int) -> DiskRecord:
        """The record for the disk file of entry `key` (written now)."""

    def allocate(self, key: int, counts: list[int]) -> list[list[int]]:
        """New pool slots for restoring entry `key`: `counts[g]` in group g, in order.
        Called once the pool has room for them; may reclaim other cached state."""

    def moved(self, key: int, tier: str) -> None:
        """Entry `key` now lives in `tier` (the host tier made room by moving it on)."""

    def discard(self, key: int) -> None:
        """The stack gave entry `key` up to make room: the store forgets it (and what
        depends on it)."""


class Tiers(Protocol):
    """The tier stack as a store uses it."""

    def bind(self, client: TierClient) -> None:
        """Set the store whose entries the stack holds (once, before any other call)."""

    def offload(self, key: int, slots: list[list[int]]) -> str | None:
        """Copy the KV rows at `slots` (per pool group, in view order) off the pool as
        entry `key`; returns the tier that took it (`CPU` or `DISK`), None if none did.
        The slots stay allocated: the store frees them."""

    def restore(self, key: int, reserve: int = 0) -> list[list[int]] | None:
        """Bring entry `key` back into new slots (from `TierClient.allocate`), with the
        same rows in the same order, and forget it; None when the stack does not hold it
        or the pool has no room for it plus `reserve` more slots."""

    def drop(self, key: int) -> None:
        """Forget entry `key` (the store dropped it)."""

    def counts(self, key: int) -> list[int] | None:
        """Rows per pool group of the held entry `key` (None: not held)."""

    def nbytes(self, counts: list[int]) -> int:
        """KV bytes of an entry with `counts` rows per pool group."""

    def scan(self) -> list[SavedEntry]:
        """The disk tier's valid entries from an earlier engine, oldest first (leftovers
        and files that do not match the fingerprint are deleted)."""

    def register(self, key: int, entry: SavedEntry) -> None:
        """Hold the found `entry` as entry `key` (in the disk tier)."""

    def delete(self, entry: SavedEntry) -> None:
        """Delete a found entry the store cannot use."""

    def persist(self, evict_all: Callable[[], None]) -> int:
        """Move the host tier to disk, then run `evict_all` (the store offloading every
        unlocked entry) with the disk as the only tier; returns files written."""

    def usage(self) -> OffloadUsage:
        """Bytes held and capacities per tier, entries offloaded and restored."""
