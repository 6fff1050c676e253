"""Offload tiers for radix-tree nodes: what a node is to the tier stack.

`RadixTree.evict` hands each unlocked node without resident children to `offload`: the
stack copies its K/V rows (every layer, in node order) to host memory or a file, its
slots go back to the pool, and the node stays in the tree, offloaded. A match that
reaches it calls `restore`: new slots from the pool, the rows copied back in the same
order. A pruned node's `positions` stay on the node and go into its file.

An entry is the node's slots in the pool's single group, named by the node's key. Its
disk file records the node's whole token path from the root, where the node starts and
its positions, under the KV fingerprint with `"cache": "radix"` (so chain and radix
files never mix). `attach` rebuilds the offloaded part of the tree from the files an
earlier engine left, parents first; a file whose parent node is not on disk too cannot
be reached and is deleted. Pure Python.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TypeGuard

from sparsevllm.engine.cache.radix_tree import Node, RadixTree
from sparsevllm.engine.cache.store import OffloadedRow
from sparsevllm.engine.cache.tiering import DISK, DiskRecord, SavedEntry, Tiers
from sparsevllm.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)


class RadixTiering:
    """The tree's `NodeTier` over the tier stack, and the stack's `TierClient`."""

    def __init__(self, tree: RadixTree, pool: KVPool, tiers: Tiers) -> None:
        self.tree = tree
        self.pool = pool
        self.tiers = tiers
        self._nodes: dict[int, Node] = {}  # key -> offloaded node (either tier)
        tree.tier = self
        tiers.bind(self)

    # -- NodeTier -----------------------------------------------------------------------
    def offload(self, node: Node) -> str | None:
        self._nodes[node.key] = node  # the stack may describe it for a file right away
        tier = self.tiers.offload(node.key, [node.slots])
        if tier is None:
            self._nodes.pop(node.key, None)
        return tier

    def restore(self, node: Node, reserve: int) -> list[int] | None:
        slots = self.tiers.restore(node.key, reserve)
        if slots is None:
            return None
        self._nodes.pop(node.key, None)
        return slots[0]

    def drop(self, node: Node) -> None:
        self._nodes.pop(node.key, None)
        self.tiers.drop(node.key)

    # -- TierClient ---------------------------------------------------------------------
    def describe(self, key: int) -> DiskRecord:
        node = self._nodes[key]
        tokens = [t for n in self.tree.path(node) for t in n.tokens]  # root to its end
        start = len(tokens) - len(node.tokens)
        name = f"radix-{uuid.uuid4().hex}"  # unique across restarts (node keys are not)
        return DiskRecord(name, tokens, {"start": start, "positions": node.positions})

    def allocate(self, key: int, counts: list[int]) -> list[list[int]]:
        return [self.pool.take_slots(counts[0])]

    def moved(self, key: int, tier: str) -> None:
        self._nodes[key].tier = tier

    def discard(self, key: int) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self.tree.discard(node)  # with its offloaded subtree

    # -- restarts -----------------------------------------------------------------------
    def attach(self) -> int:
        """Rebuild the offloaded nodes an earlier engine left on disk (parents first);
        files nothing can reach are deleted. Returns how many nodes came back."""
        saved = self.tiers.scan()  # oldest first
        placed: dict[Path, Node] = {}
        for entry in sorted(saved, key=_start):
            node = self._graft(entry)
            if node is None:
                logger.warning("disk tier: %s has no parent node on disk; deleted", entry.path)
                self.tiers.delete(entry)
            else:
                placed[entry.path] = node
        for entry in saved:  # the disk index keeps its least recently written order
            node = placed.get(entry.path)
            if node is not None:
                self.tiers.register(node.key, entry)
                self._nodes[node.key] = node
        return len(placed)

    def _graft(self, entry: SavedEntry) -> Node | None:
        start, positions = entry.meta.get("start"), entry.meta.get("positions")
        if not isinstance(start, int):
            return None
        if positions is None:
            return self.tree.graft(entry.tokens, start, None, DISK)
        if _int_list(positions):
            return self.tree.graft(entry.tokens, start, positions, DISK)
        return None

    # -- listings -----------------------------------------------------------------------
    def listing(self) -> list[OffloadedRow]:
        """Every offloaded node: its tier, where its tokens lie in the prefix, its rows
        and their KV bytes; by position."""
        out: list[OffloadedRow] = []
        for node, start in self.tree.offloaded():
            counts = self.tiers.counts(node.key)
            rows = counts[0] if counts else 0
            out.append(
                {
                    "tier": str(node.tier),
                    "start": start,
                    "logical_tokens": start + len(node.tokens),
                    "tokens": len(node.tokens),
                    "rows": rows,
                    "bytes": self.tiers.nbytes([rows]),
                }
            )
        return sorted(out, key=lambda r: (r["start"], r["logical_tokens"]))


def _start(entry: SavedEntry) -> int:
    start = entry.meta.get("start")
    return start if isinstance(start, int) else -1


def _int_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(p, int) for p in value)
