"""Radix tree of cached prefixes: token-id prefixes -> KV slot runs, shared by locks.

Pure Python, like the scheduler. The radix store (`radix_store.py`) keeps it for methods
whose storage stays a plain prefix (dense and logical methods, one pool group). A
finished request hands its computed tokens' slots to the tree instead of freeing them; a
new request whose prompt starts with a cached prefix borrows those slots and prefills
only the rest. Nodes used by a running request are locked; unlocked nodes are evicted
least-recently-used, leaves first, whenever the pool needs slots.

A node may be *pruned*: it then holds fewer slots than tokens, and `positions` gives the
offset within the node of the token each slot holds. Matching stays by tokens, so a
request borrowing a pruned prefix still skips all of its tokens (its positions stay
logical) while reading a shorter view.

With an offload tier (`NodeTier`, set as `tier`: the radix store over the tier stack),
an evicted node is not dropped: its KV moves to host memory or disk and the node stays
in the tree, *offloaded* (`tier` names where; it holds no slots). Nodes are offloaded
leaves first, so every descendant of an offloaded node is offloaded too: the resident
nodes form the top of the tree. A match that reaches an offloaded node restores it
before the request reads it, or stops there when the pool has no room.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Protocol

_keys = itertools.count(1)


class Node:
    """A run of tokens below its parent's, with the slots holding their KV."""

    __slots__ = (
        "tokens",
        "slots",
        "positions",
        "children",
        "parent",
        "ref",
        "last_used",
        "key",
        "tier",
    )

    def __init__(
        self,
        tokens: list[int],
        slots: list[int],
        parent: Node | None,
        positions: list[int] | None = None,
    ) -> None:
        self.tokens = tokens
        self.slots = slots
        # None: one slot per token. Pruned: the offset in `tokens` of each slot's token.
        self.positions = positions
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.ref = 0
        self.last_used = 0
        self.key = next(_keys)  # names the node's entry in an offload tier
        self.tier: str | None = None  # "CPU" or "disk" while offloaded (no slots held)

    def up(self) -> Node:
        """The parent (every node but the root has one)."""
        if self.parent is None:
            raise RuntimeError("the root has no parent")
        return self.parent


class NodeTier(Protocol):
    """Where evicted nodes' KV goes instead of being dropped (`radix_tiering.py`)."""

    def offload(self, node: Node) -> str | None:
        """Copy the node's rows off the pool; the tier's name, or None (no room)."""

    def restore(self, node: Node, reserve: int) -> list[int] | None:
        """New slots holding the node's rows again (None: the pool has no room for them
        plus `reserve` more)."""

    def drop(self, node: Node) -> None:
        """Forget the node's offloaded copy (it leaves the tree)."""


class RadixTree:
    """`free_slots` is called with the slots of evicted nodes (the pool's free list)."""

    def __init__(self, free_slots: Callable[[list[int]], None] | None = None) -> None:
        self.free_slots = free_slots
        self.root = Node([], [], None)
        self.root.ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached_slots = 0
        self.num_evictable_slots = 0
        self.tier: NodeTier | None = None

    # -- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], reserve: int = 0) -> tuple[list[int], Node]:
        """Longest cached prefix of `tokens`: its slots and the deepest node reached.

        A partial match inside a node splits it, so the prefix ends on a node boundary.
        Offloaded nodes are restored only while the pool keeps `reserve` slots besides.
        """
        node, pos, slots = self.root, 0, []
        now = next(self._clock)
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            if child.tier is not None and not self._bring_back(node, child, reserve):
                break  # no room to restore: the request computes the rest itself
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = now
            slots.extend(child.slots)
            node, pos = child, pos + n
        return slots, node

    def _bring_back(self, parent: Node, node: Node, reserve: int) -> bool:
        """Restore the offloaded `node` below `parent`. The path above stays locked
        meanwhile: making room for the rows must not evict what the match holds."""
        if self.tier is None:
            return False
        self.lock(parent)
        try:
            slots = self.tier.restore(node, reserve)
        finally:
            self.unlock(parent)
        if slots is None:
            return False
        node.slots, node.tier = slots, None
        self._count(node, len(slots))
        return True

    def depth(self, node: Node) -> int:
        """Logical tokens from the root to the end of `node`."""
        return sum(len(n.tokens) for n in self.path(node))

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root (excluded) down to `node`."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.up()
        return out[::-1]

    def view(self, node: Node) -> tuple[list[int], list[int]]:
        """Slots of the path to `node` and the logical position of each slot's token."""
        slots: list[int] = []
        positions: list[int] = []
        start = 0
        for n in self.path(node):
            slots.extend(n.slots)
            positions.extend(start + p for p in _offsets(n))
            start += len(n.tokens)
        return slots, positions

    def lock(self, node: Node) -> None:
        """Pin `node` and its ancestors (a running request reads their slots)."""
        while node is not self.root:
            if node.ref == 0:
                self.num_evictable_slots -= len(node.slots)
            node.ref += 1
            node = node.up()

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.num_evictable_slots += len(node.slots)
            node = node.up()

    # -- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: list[int], start: int = 0) -> list[int]:
        """Adopt `slots`, one per token of `tokens[start:]` (the tree already holds the
        first `start` tokens: the prefix the sequence borrowed); return the slots not
        adopted because the tree holds those positions already (the caller frees them)."""
        node, pos = self.root, 0
        duplicates: list[int] = []
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is not None and child.tier is not None:
                child = self._supersede(child, tokens, slots, pos, start)
            if child is None:
                if pos < start:
                    raise RuntimeError("a borrowed prefix left the cache while in use")
                leaf = Node(tokens[pos:], slots[pos - start :], node)
                leaf.last_used = now
                node.children[tokens[pos]] = leaf
                self._count(leaf, len(leaf.slots))
                return duplicates
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            if pos + n > start:
                offset = max(start - pos, 0)
                mine = slots[pos + offset - start : pos + n - start]
                duplicates.extend(_duplicates(child, mine, offset))
            child.last_used = now
            node, pos = child, pos + n
        return duplicates

    def _supersede(
        self, node: Node, tokens: list[int], slots: list[int], pos: int, start: int
    ) -> Node | None:
        """A finished request computed the tokens of the offloaded `node` itself (it was
        offloaded, or could not be restored, while the request ran). Covering the whole
        node, the request's copy replaces the offloaded one and its descendants stay;
        ending or branching inside it, the node and its subtree are dropped (cutting
        offloaded rows in two is not worth it) and a new leaf takes their place."""
        if pos < start:  # a borrowed node is locked, so never offloaded
            raise RuntimeError("a borrowed prefix was offloaded while in use")
        n = _common(node.tokens, tokens, pos)
        if n < len(node.tokens):
            self._discard(node)
            return None
        self._tier().drop(node)
        node.slots = slots[pos - start : pos + n - start]
        node.positions, node.tier = None, None
        self._count(node, len(node.slots))
        return node

    def adopt(self, tokens: list[int], view: list[int], borrowed: Node | None) -> list[int]:
        """Take a finished sequence's KV. `view` holds the slots it borrowed through
        `borrowed` (None: nothing), then one slot per later token of `tokens` (and maybe
        unused ones). Returns the slots the caller frees."""
        start = self.depth(borrowed) if borrowed is not None else 0
        num_borrowed = len(self.view(borrowed)[0]) if borrowed is not None else 0
        own = view[num_borrowed:]
        used = len(tokens) - start
        return self.insert(tokens, own[:used], start) + own[used:]

    def _split(self, node: Node, n: int) -> Node:
        """Cut `node` after n tokens; return the new upper half (same ref count)."""
        if node.tier is not None:
            raise RuntimeError("an offloaded node is restored before it is split")
        if node.positions is None:
            k, upper_pos, lower_pos = n, None, None
        else:
            k = bisect.bisect_left(node.positions, n)
            upper_pos = _compact(node.positions[:k], n)
            lower_pos = _compact([p - n for p in node.positions[k:]], len(node.tokens) - n)
        upper = Node(node.tokens[:n], node.slots[:k], node.parent, upper_pos)
        upper.ref, upper.last_used = node.ref, node.last_used
        node.up().children[node.tokens[0]] = upper
        node.tokens, node.slots, node.parent = node.tokens[n:], node.slots[k:], upper
        node.positions = lower_pos
        upper.children[node.tokens[0]] = node
        return upper

    def drop_slots(self, node: Node, dropped: set[int]) -> int:
        """Pruning: remove the `dropped` slots from an unlocked node (the caller frees
        them); its tokens stay matchable. Returns how many were removed."""
        if node.ref:
            raise RuntimeError("a node in use cannot be pruned")
        kept = [(s, p) for s, p in zip(node.slots, _offsets(node)) if s not in dropped]
        removed = len(node.slots) - len(kept)
        node.slots = [s for s, _ in kept]
        node.positions = _compact([p for _, p in kept], len(node.tokens))
        self._count(node, -removed)
        return removed

    def _tier(self) -> NodeTier:
        if self.tier is None:  # offloaded nodes exist only with a tier
            raise RuntimeError("an offloaded node without an offload tier")
        return self.tier

    def _count(self, node: Node, n: int) -> None:
        """`n` slots joined (or, negative, left) the tree at `node`."""
        self.num_cached_slots += n
        if node.ref == 0:
            self.num_evictable_slots += n

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
        """Free at least `n` slots (if possible) from unlocked nodes, LRU leaves first
        (with a tier: nodes without resident children). A node the tier takes stays in
        the tree, offloaded; one it cannot take leaves with its offloaded subtree."""
        freed: list[int] = []
        while len(freed) < n:
            leaf = self._lru_unlocked_leaf()
            if leaf is None:
                break
            tier = self.tier.offload(leaf) if self.tier is not None else None
            if tier is None:
                freed.extend(self._remove(leaf))
                continue
            freed.extend(leaf.slots)
            self._count(leaf, -len(leaf.slots))
            leaf.slots, leaf.tier = [], tier
        return freed

    def _lru_unlocked_leaf(self) -> Node | None:
        best, stack = None, [self.root]
        while stack:
            node = stack.pop()
            resident = [c for c in node.children.values() if c.tier is None]
            if not resident and node.ref == 0 and node is not self.root:
                if best is None or node.last_used < best.last_used:
                    best = node
            stack.extend(resident)  # below an offloaded node, every node is offloaded
        return best

    def discard(self, node: Node) -> None:
        """An offload tier gave up `node`'s copy: the node and its subtree leave (unless
        they left already, with an ancestor)."""
        n = node
        while n is not self.root:
            if n.parent is None or n.parent.children.get(n.tokens[0]) is not n:
                return
            n = n.parent
        self._discard(node)

    def _discard(self, node: Node) -> None:
        freed = self._remove(node)
        if freed and self.free_slots is not None:
            self.free_slots(freed)

    def _remove(self, node: Node) -> list[int]:
        """Take unlocked `node` and its subtree out of the tree; returns their slots (the
        caller frees them) and drops their offloaded copies."""
        del node.up().children[node.tokens[0]]
        freed, stack = [], [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.tier is not None:
                self._tier().drop(n)
            else:
                freed.extend(n.slots)
                self._count(n, -len(n.slots))
        return freed

    def graft(
        self, path: list[int], start: int, positions: list[int] | None, tier: str
    ) -> Node | None:
        """Add an offloaded node for `path[start:]` below the node that ends at `start`
        (a tier rebuilding the tree); None when no node ends there or the place is taken."""
        node, pos = self.root, 0
        while pos < start:
            below = node.children.get(path[pos])
            if below is None or below.tokens != path[pos : pos + len(below.tokens)]:
                return None
            node, pos = below, pos + len(below.tokens)
        if pos != start or start >= len(path) or path[start] in node.children:
            return None
        child = Node(path[start:], [], node, positions)
        child.tier = tier
        node.children[path[start]] = child
        return child

    def offloaded(self) -> list[tuple[Node, int]]:
        """Every offloaded node and the logical position its tokens start at."""
        out, stack = [], [(self.root, 0)]
        while stack:
            node, start = stack.pop()
            if node.tier is not None:
                out.append((node, start))
            end = start + len(node.tokens)
            stack.extend((c, end) for c in node.children.values())
        return out

    def entries(self) -> list[tuple[int, int]]:
        """(logical tokens, resident slots) of every cached leaf path, for listings."""
        out, stack = [], [(self.root, 0, 0)]
        while stack:
            node, depth, resident = stack.pop()
            depth += len(node.tokens)
            resident += len(node.slots)
            if not node.children and node is not self.root:
                out.append((depth, resident))
            stack.extend((c, depth, resident) for c in node.children.values())
        return out


def _offsets(node: Node) -> list[int]:
    return list(range(len(node.slots))) if node.positions is None else node.positions


def _compact(positions: list[int], length: int) -> list[int] | None:
    """None when every token of a `length`-token node has its slot (no pruning)."""
    return None if len(positions) == length else positions


def _duplicates(node: Node, mine: list[int], offset: int) -> list[int]:
    """Of a sequence's slots for node tokens offset.., those the node does not share."""
    if node.positions is None:
        theirs = node.slots[offset : offset + len(mine)]
        return [s for s, c in zip(mine, theirs) if s != c]
    held = set(node.slots)
    return [s for s in mine if s not in held]


def _common(a: list[int], tokens: list[int], pos: int) -> int:
    n = 0
    limit = min(len(a), len(tokens) - pos)
    while n < limit and a[n] == tokens[pos + n]:
        n += 1
    return n
