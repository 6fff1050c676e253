"""The radix prefix cache as a `PrefixStore` (dense and logical methods).

A finished request's computed tokens (prompt and generated, all but the last sampled
token) go into the radix tree (`radix_tree.py`) with their slots; a new request borrows
the slots of its longest cached prefix when it is admitted, and its borrowed path stays
locked until it ends. Nothing is named, so `claim` finds nothing: matching waits for
admission, when the pool's room is known. With offload tiers (`radix_tiering.py`),
evicted nodes move to host memory or disk and come back on the next hit.

Pruning drops chosen slots from the nodes covering the ranges: one selection for every
layer and head, since dense storage shares one slot table.

A copy of a cached prefix (`clone`, for the throughput benchmark's decode-capacity mode)
must be matched by tokens of its own, or a request would find the original: it is cached
under the original's tokens with the first one replaced by a token that no cached entry
starts with, in new slots holding the original's rows. Its KV is then that of other
tokens (synthetic: what a benchmark of decode timing and memory needs), and no two
entries share a slot. Pure Python.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from sparsevllm.engine.cache.radix_tiering import RadixTiering
from sparsevllm.engine.cache.radix_tree import Node, RadixTree
from sparsevllm.engine.cache.store import (
    NO_CLAIM,
    CachedCopy,
    CacheEntryNotFound,
    CacheListing,
    ChainBusyError,
    Claim,
    KVPruner,
    PruneResult,
    PruneSpec,
    PruneTarget,
    RowCopier,
    StoreStats,
    store_stats,
)
from sparsevllm.engine.cache.tiering import Tiers
from sparsevllm.engine.kv_pool import KVPool, PoolExhausted
from sparsevllm.engine.sequence import Sequence


class RadixStore:
    """`PrefixStore` over a radix tree of the pool's single layer group; `rows` copies KV
    rows for `clone`."""

    parks_views = False

    def __init__(
        self,
        pool: KVPool,
        pruner: KVPruner,
        tiers: Tiers | None = None,
        rows: RowCopier | None = None,
    ) -> None:
        self.pool = pool
        self.pruner = pruner
        self.rows = rows
        self.tree = RadixTree(free_slots=pool.free_slots)
        self.tiers = tiers
        self.tiering = RadixTiering(self.tree, pool, tiers) if tiers is not None else None
        self._locked: dict[int, Node] = {}  # seq_id -> deepest node of its borrowed prefix

    def borrowed_node(self, seq_id: int) -> Node | None:
        """The deepest node of the prefix a running sequence borrowed (None: none)."""
        return self._locked.get(seq_id)

    # -- requests -----------------------------------------------------------------------
    def claim(self, tokens: list[int], chain_id: str | None, method: str | None = None) -> Claim:
        # No named state: a prefix is matched when the request is admitted. Every method
        # the radix cache serves stores a plain prefix, so any of them may reuse it.
        return NO_CLAIM

    def match_and_lock(self, seq: Sequence, reserve: int) -> int:
        # At least one token must be computed: its logits give the next token.
        slots, node = self.tree.match(seq.token_slice(0, seq.num_tokens - 1), reserve)
        # A pruned prefix holds fewer slots than tokens: count its tokens (positions stay
        # logical), read its slots.
        cached = self.tree.depth(node)
        if not cached:
            return 0
        self.tree.lock(node)
        self._locked[seq.seq_id] = node
        self.pool.attach(seq.seq_id, slots)
        return cached

    def finish(self, seq: Sequence) -> bool:
        slots = self.pool.detach(seq.seq_id)
        node = self._locked.pop(seq.seq_id, None)
        tokens = seq.token_slice(0, seq.num_computed_tokens)
        self.pool.free_slots(self.tree.adopt(tokens, slots, node))
        if node is not None:
            self.tree.unlock(node)
        return False  # only slots are kept: the method's per-sequence state may go

    def release(self, seq: Sequence) -> None:
        node = self._locked.pop(seq.seq_id, None)
        if node is not None:
            self.tree.unlock(node)

    # -- memory pressure ----------------------------------------------------------------
    @property
    def reclaimable_slots(self) -> int:
        return self.tree.num_evictable_slots

    def make_room(self, n: int) -> None:
        self.tree.make_room(n)

    # -- pruning ------------------------------------------------------------------------
    def prune(self, target: PruneTarget, spec: PruneSpec) -> PruneResult:
        if target.chain_id is not None or target.tokens is None:
            raise ValueError(
                "this engine uses the radix prefix cache, which has no chains: identify "
                "the cached prefix by its prompt or token ids"
            )
        self.pruner.check_shared()
        tokens, tree = target.tokens, self.tree
        _, node = tree.match(tokens)  # restores offloaded nodes on the way
        length = tree.depth(node)
        _check_restored(node, tokens, length)
        if length == 0:
            raise CacheEntryNotFound("no cached prefix of these tokens")
        spec.check_within(length, "the cached prefix")
        path = tree.path(node)
        _check_unlocked(path, spec.ranges)
        slots, logical = tree.view(node)
        kept = {slots[i] for i in self.pruner.keep_shared(slots, logical, spec)}
        dropped = {s for s in slots if s not in kept}
        for n in path:
            if dropped.intersection(n.slots):
                tree.drop_slots(n, dropped)
        self.pool.free_slots(sorted(dropped))
        return PruneResult(
            "prefix",
            None,
            length,
            len(slots),
            len(slots) - len(dropped),
            spec.method,
            spec.keep_ratio,
            spec.ranges,
        )

    # -- copies (benchmarks) ------------------------------------------------------------
    def clone(
        self, target: PruneTarget, count: int, first_tokens: Iterable[int]
    ) -> list[CachedCopy]:
        """The original and the copies made so far stay locked while copies are made, so
        that making room for the next one never evicts them."""
        if self.rows is None:
            raise RuntimeError("this radix store was built without a KV copier")
        if target.chain_id is not None or not target.tokens:
            raise ValueError("the radix prefix cache has no chains: name the prefix by its tokens")
        tokens, tree = target.tokens, self.tree
        src, node = tree.match(tokens)  # restores offloaded nodes on the way
        cached = tree.depth(node)
        if cached < len(tokens):
            raise CacheEntryNotFound(
                f"{cached} of the {len(tokens)} tokens are cached: only a cached prefix is copied"
            )
        if len(src) != cached:
            raise ValueError("a pruned prefix (fewer slots than tokens) is not copied")
        firsts = self._free_first_tokens(first_tokens, count)
        tree.lock(node)
        made: list[Node] = []
        try:
            for first in firsts:
                made.append(self._copy([first, *tokens[1:]], src, self.rows))
        except BaseException as e:
            for leaf in made:  # nothing is copied unless every copy fits
                tree.unlock(leaf)
                tree.discard(leaf)
            if not isinstance(e, PoolExhausted):
                raise
            raise PoolExhausted(
                f"the KV pool cannot hold {count} copies of a {cached}-token cached prefix: "
                f"{len(made)} fit, {self.pool.num_free} of {self.pool.num_slots} slots free"
            ) from e
        finally:
            tree.unlock(node)
        for leaf in made:
            tree.unlock(leaf)
        return [CachedCopy(list(leaf.tokens), None) for leaf in made]

    def _free_first_tokens(self, first_tokens: Iterable[int], count: int) -> list[int]:
        """`count` ids of `first_tokens` that no cached entry starts with (a copy cached
        under one shares no node, hence no slot, with any other entry)."""
        taken = self.tree.root.children
        free = (t for t in dict.fromkeys(first_tokens) if t not in taken)
        firsts = list(itertools.islice(free, count))
        if len(firsts) < count:
            raise ValueError(
                f"{count} copies of a cached prefix need as many token ids that no cached "
                f"prefix starts with; {len(firsts)} are left"
            )
        return firsts

    def _copy(self, tokens: list[int], src: list[int], rows: RowCopier) -> Node:
        """One copy: new slots (making room evicts only unlocked nodes), the rows copied
        into them, and a new leaf below the root for `tokens`, locked."""
        dst = self.pool.take_slots(len(src))
        try:
            rows.copy([src], [dst])
        except BaseException:
            self.pool.free_slots(dst)
            raise
        if self.tree.insert(tokens, dst):  # its first token is new: nothing is shared
            raise RuntimeError("a copy of a cached prefix shares slots with another entry")
        leaf = self.tree.root.children[tokens[0]]
        self.tree.lock(leaf)
        return leaf

    # -- listings and the disk tier -----------------------------------------------------
    def listing(self) -> CacheListing:
        out: CacheListing = {
            "mode": "radix",
            "chains": [],
            "prefixes": [
                {"tokens": t, "logical_tokens": t, "resident_slots": r}
                for t, r in sorted(self.tree.entries(), reverse=True)
            ],
            "kv_slots_cached": self.tree.num_cached_slots,
        }
        if self.tiering is not None:
            out["offload"] = self.tiering.tiers.usage()
            out["offloaded"] = self.tiering.listing()
        return out

    def stats(self) -> StoreStats:
        usage = self.tiering.tiers.usage() if self.tiering is not None else None
        return store_stats(self.tree.num_cached_slots, 0, usage)

    def attach(self) -> int:
        return self.tiering.attach() if self.tiering is not None else 0

    def persist(self) -> int:
        if self.tiering is None:
            return 0
        # Everything unlocked, least recently used leaves first: the disk cap then drops
        # the deepest, oldest nodes before their parents.
        return self.tiering.tiers.persist(lambda: self.make_room(self.reclaimable_slots + 1))


def _check_restored(node: Node, tokens: list[int], length: int) -> None:
    """The match stopped before an offloaded node: the pool had no room to restore it."""
    stopped = node.children.get(tokens[length]) if length < len(tokens) else None
    if stopped is not None and stopped.tier is not None:
        raise ChainBusyError(
            f"cached tokens from {length} on are offloaded ({stopped.tier}) and the KV pool "
            "has no room to restore them now; retry later"
        )


def _check_unlocked(path: list[Node], ranges: list[tuple[int, int]]) -> None:
    start = 0
    for node in path:
        end = start + len(node.tokens)
        if node.ref and any(s < end and start < e for s, e in ranges):
            raise ChainBusyError(
                f"cached tokens [{start}, {end}) are in use by a running request; "
                "retry when it finishes"
            )
        start = end
