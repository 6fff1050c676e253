"""Radix prefix cache: token-id prefixes -> KV slot runs, shared by reference counts.

Pure Python, like the scheduler. Used by methods whose storage stays a plain prefix
(dense and logical methods, one pool group). A finished request hands its computed
tokens' slots to the tree instead of freeing them; a new request whose prompt starts
with a cached prefix borrows those slots and prefills only the rest. Nodes used by a
running request are locked; unlocked nodes are evicted least-recently-used, leaves
first, whenever the pool needs slots.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable


class _Node:
    __slots__ = ("tokens", "slots", "children", "parent", "ref", "last_used")

    def __init__(self, tokens: list[int], slots: list[int], parent: _Node | None) -> None:
        self.tokens = tokens
        self.slots = slots
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_used = 0


class RadixCache:
    """`free_slots` is called with the slots of evicted nodes (the pool's free list)."""

    def __init__(self, free_slots: Callable[[list[int]], None] | None = None) -> None:
        self.free_slots = free_slots
        self.root = _Node([], [], None)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached_slots = 0
        self.num_evictable_slots = 0

    # -- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> tuple[list[int], _Node]:
        """Longest cached prefix of `tokens`: its slots and the deepest node reached.

        A partial match inside a node splits it, so the prefix ends on a node boundary.
        """
        node, pos, slots = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            slots.extend(child.slots)
            node, pos = child, pos + n
        return slots, node

    def lock(self, node: _Node) -> None:
        """Pin `node` and its ancestors (a running request reads their slots)."""
        while node is not self.root:
            if node.ref == 0:
                self.num_evictable_slots -= len(node.slots)
            node.ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable_slots += len(node.slots)
            node = node.parent

    # -- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: list[int]) -> list[int]:
        """Adopt `slots` (one per token) for `tokens`; return the slots not adopted
        because the tree already holds KV for those positions (the caller frees them)."""
        node, pos, duplicates = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(tokens[pos:], slots[pos:], node)
                leaf.last_used = now
                node.children[tokens[pos]] = leaf
                self.num_cached_slots += len(leaf.slots)
                self.num_evictable_slots += len(leaf.slots)
                return duplicates
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            duplicates.extend(s for s, c in zip(slots[pos : pos + n], child.slots) if s != c)
            child.last_used = now
            node, pos = child, pos + n
        return duplicates

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after n tokens; return the new upper half (same ref count)."""
        upper = _Node(node.tokens[:n], node.slots[:n], node.parent)
        upper.ref, upper.last_used = node.ref, node.last_used
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[n:], node.slots[n:], upper
        upper.children[node.tokens[0]] = node
        return upper

    # -- eviction -----------------------------------------------------------------------
    @property
    def reclaimable_slots(self) -> int:
        return self.num_evictable_slots

    def make_room(self, n: int) -> None:
        """Evict unlocked nodes until `n` slots went back to the pool (or none is left)."""
        freed = self.evict(n)
        if self.free_slots is not None:
            self.free_slots(freed)

    def evict(self, n: int) -> list[int]:
        """Free at least `n` slots (if possible) from unlocked nodes, LRU leaves first."""
        freed: list[int] = []
        while len(freed) < n:
            leaf = self._lru_unlocked_leaf()
            if leaf is None:
                break
            freed.extend(leaf.slots)
            del leaf.parent.children[leaf.tokens[0]]
            self.num_cached_slots -= len(leaf.slots)
            self.num_evictable_slots -= len(leaf.slots)
        return freed

    def _lru_unlocked_leaf(self) -> _Node | None:
        best, stack = None, [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node.ref == 0 and node is not self.root:
                if best is None or node.last_used < best.last_used:
                    best = node
            stack.extend(node.children.values())
        return best

    def entries(self) -> list[tuple[int, int]]:
        """(tokens, resident slots) of every cached leaf path, for listings."""
        out, stack = [], [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            depth += len(node.tokens)
            if not node.children and node is not self.root:
                out.append((depth, depth))
            stack.extend((c, depth) for c in node.children.values())
        return out


def _common(a: list[int], tokens: list[int], pos: int) -> int:
    n = 0
    limit = min(len(a), len(tokens) - pos)
    while n < limit and a[n] == tokens[pos + n]:
        n += 1
    return n
