"""The chain cache as a `PrefixStore` (eviction methods).

A finished turn keeps its whole sequence state (retained KV, view positions, method
state) as an idle chain named by its chain id (`chains.py`). A request continues a chain
when it is added (`claim`): by the chain id it names, or the longest idle chain its
tokens extend. Claiming then, not at admission, is what lets a second writer of a busy
chain be refused at once (`ChainBusyError`, HTTP 409) and gives every output its chain
id and status from the start; the continuing request takes over the chain's owner id,
so at admission its state is already its own and nothing is left to match. With offload
tiers (`chain_tiering.py`), idle chains move to host memory or disk under pressure.

Pruning compresses the chain's views in place, per KV head where storage has one group
per layer. A copy of an idle chain (`clone`, for the throughput benchmark's
decode-capacity mode) is a new chain under a new owner: new slots holding the rows
copied on the device, and the owner's per-sequence state copied too. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sparsevllm.engine.cache.chain_tiering import ChainTiering
from sparsevllm.engine.cache.chains import Chain, ChainCache
from sparsevllm.engine.cache.store import (
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
    StateCopier,
    StoreStats,
    store_stats,
)
from sparsevllm.engine.cache.tiering import Tiers
from sparsevllm.engine.kv_pool import KVPool, PoolExhausted
from sparsevllm.engine.sequence import Sequence


class ChainStore:
    """`PrefixStore` over idle chains. `release_state(owner)` frees the per-sequence
    state a dropped chain kept outside the pool (the method's, the device row);
    `new_owner()` names the sequence id a chain found on disk (or a copy) is kept under;
    `rows` and `state` copy a chain's KV rows and per-sequence state (`clone`)."""

    parks_views = True

    def __init__(
        self,
        pool: KVPool,
        pruner: KVPruner,
        release_state: Callable[[int], None],
        new_owner: Callable[[], int],
        tiers: Tiers | None = None,
        rows: RowCopier | None = None,
        state: StateCopier | None = None,
    ) -> None:
        self.pool = pool
        self.pruner = pruner
        self.release_state = release_state
        self.new_owner = new_owner
        self.tiers = tiers
        self.rows = rows
        self.state = state
        self.chains = ChainCache(on_drop=self._drop)
        self.tiering = ChainTiering(self.chains, pool, tiers) if tiers is not None else None

    def _drop(self, owner: int) -> None:
        """An idle chain is reclaimed or dropped: free its slots, its offloaded copy and
        its method state."""
        self.pool.release(owner)
        if self.tiers is not None:
            self.tiers.drop(owner)
        self.release_state(owner)

    # -- requests -----------------------------------------------------------------------
    def claim(self, tokens: list[int], chain_id: str | None, method: str | None = None) -> Claim:
        chain, status = self.chains.acquire(tokens, chain_id, method)
        if chain is None:
            return Claim(None, chain_id or self.chains.new_id(), status, 0)
        return Claim(chain.owner, chain.chain_id, status, len(chain.tokens))

    def match_and_lock(self, seq: Sequence, reserve: int) -> int:
        # A chain was claimed (found, restored, marked busy) when its request was added;
        # a request without one starts fresh.
        return 0

    def finish(self, seq: Sequence) -> bool:
        if seq.chain_id is None:
            raise RuntimeError(f"sequence {seq.seq_id} finished without a claimed chain id")
        tokens = seq.token_slice(0, seq.num_computed_tokens)
        method = seq.method.key if seq.method is not None else None
        footprint = self._footprint(seq.seq_id)
        if self.chains.park(seq.chain_id, seq.seq_id, tokens, *footprint, method=method):
            return True  # the method keeps its per-sequence state for the chain
        # Another request extends a chain of this id (it named the id too, or continued
        # the chain parked under it meanwhile): that writer keeps it, this turn's state goes.
        self.pool.release(seq.seq_id)
        return False

    def _footprint(self, owner: int) -> tuple[int, int]:
        """Slots `owner` holds in its fullest and in its emptiest main layer group."""
        counts = [self.pool.num_resident(owner, g) for g in range(self.pool.num_main_groups)]
        return max(counts), min(counts)

    def release(self, seq: Sequence) -> None:
        self.chains.forget(seq.chain_id, seq.seq_id)  # a continued chain's state is gone

    # -- memory pressure ----------------------------------------------------------------
    @property
    def reclaimable_slots(self) -> int:
        """How much the pool's `num_free` (its fullest group's) would grow if every idle
        resident chain went. Summing each chain's emptiest-group count would undercount it
        where chains hold far more in some groups than in others (DuoAttention keeps every
        token in its retrieval layers and a window in its streaming ones), and admission
        could then wait forever on room it has."""
        idle = self.chains.idle_resident()
        if not idle:
            return 0
        after = min(
            self.pool.num_free_in(g) + sum(self.pool.num_resident(c.owner, g) for c in idle)
            for g in range(self.pool.num_main_groups)
        )
        return after - self.pool.num_free

    def make_room(self, n: int) -> None:
        self.chains.make_room(n)

    # -- pruning ------------------------------------------------------------------------
    def prune(self, target: PruneTarget, spec: PruneSpec) -> PruneResult:
        chain = self._find(target)
        if chain.busy:
            raise ChainBusyError(f"chain {chain.chain_id!r} is busy: a running request extends it")
        spec.check_within(len(chain.tokens), f"chain {chain.chain_id!r}")
        if not self.chains.bring_back(chain):
            raise ChainBusyError(
                f"chain {chain.chain_id!r} is offloaded and the KV pool has no room to restore "
                "it now; retry later"
            )
        before = chain.resident
        self.pruner.prune_views(chain.owner, spec)
        chain.resident, chain.reclaim = self._footprint(chain.owner)
        return PruneResult(
            "chain",
            chain.chain_id,
            len(chain.tokens),
            before,
            chain.resident,
            spec.method,
            spec.keep_ratio,
            spec.ranges,
        )

    def _find(self, target: PruneTarget) -> Chain:
        chains = self.chains.chains
        if target.chain_id is not None:
            chain = chains.get(target.chain_id)
            if chain is None:
                raise CacheEntryNotFound(
                    f"no chain {target.chain_id!r} (never created, or reclaimed)"
                )
            return chain
        tokens = target.tokens or []
        found = [c for c in chains.values() if _related(c.tokens, tokens)]
        if not found:
            raise CacheEntryNotFound("no chain's history starts with or extends these tokens")
        if len(found) > 1:
            names = ", ".join(repr(c.chain_id) for c in found[:5])
            raise ValueError(f"{len(found)} chains match these tokens ({names}): pass chain_id")
        return found[0]

    # -- copies (benchmarks) ------------------------------------------------------------
    def clone(
        self, target: PruneTarget, count: int, first_tokens: Iterable[int]
    ) -> list[CachedCopy]:
        """Copies keep the chain's tokens (chains are named by id: `first_tokens` is not
        needed). The chain stays busy while it is copied, and so do the copies made so
        far, so that making room for the next one never reclaims them."""
        if self.rows is None or self.state is None:
            raise RuntimeError("this chain store was built without a KV copier")
        chain = self._find(target)
        if chain.busy:
            raise ChainBusyError(f"chain {chain.chain_id!r} is busy: a running request extends it")
        if not self.chains.bring_back(chain):
            raise ChainBusyError(
                f"chain {chain.chain_id!r} is offloaded and the KV pool has no room to restore it"
            )
        chain.busy = True
        made: list[Chain] = []
        try:
            for _ in range(count):
                made.append(self._copy(chain, self.rows, self.state))
        except BaseException as e:
            for copy in made:  # nothing is copied unless every copy fits
                self.chains.drop(copy)
            if not isinstance(e, PoolExhausted):
                raise
            raise PoolExhausted(
                f"the KV pool cannot hold {count} copies of chain {chain.chain_id!r} "
                f"({chain.resident} slots per layer each): {len(made)} fit, "
                f"{self.pool.num_free} of {self.pool.num_slots} slots per layer are free"
            ) from e
        finally:
            for c in (chain, *made):
                c.busy = False
        return [CachedCopy(list(c.tokens), c.chain_id) for c in made]

    def _copy(self, chain: Chain, rows: RowCopier, state: StateCopier) -> Chain:
        """One copy of `chain`: a new owner with as many slots per pool group (window
        groups included), the rows and the per-sequence state copied into them."""
        groups = range(self.pool.num_groups)
        owner = self.new_owner()
        # Raises PoolExhausted before allocating anything when the slots do not fit.
        self.pool.append_per_group(owner, [self.pool.num_resident(chain.owner, g) for g in groups])
        copy = self.chains.add_copy(chain, owner)  # dropping it now frees what it holds
        try:
            rows.copy(
                [self.pool.table(chain.owner, g) for g in groups],
                [self.pool.table(owner, g) for g in groups],
            )
            state.copy(chain.owner, owner)
        except BaseException:
            self.chains.drop(copy)
            raise
        return copy

    # -- listings and the disk tier -----------------------------------------------------
    def listing(self) -> CacheListing:
        out: CacheListing = {
            "mode": "chain",
            "chains": self.chains.listing(),
            "prefixes": [],
            "kv_slots_cached": self.chains.cached_slots,
        }
        if self.tiers is not None:
            out["offload"] = self.tiers.usage()
        return out

    def stats(self) -> StoreStats:
        idle = sum(not c.busy for c in self.chains.chains.values())
        usage = self.tiers.usage() if self.tiers is not None else None
        return store_stats(self.chains.cached_slots, idle, usage)

    def attach(self) -> int:
        return self.tiering.attach(self.new_owner) if self.tiering is not None else 0

    def persist(self) -> int:
        if self.tiers is None:
            return 0
        # Every idle chain, least recently used first, so the newest survive the disk cap.
        return self.tiers.persist(lambda: self.make_room(self.reclaimable_slots + 1))


def _related(a: list[int], b: list[int]) -> bool:
    """One token list is a prefix of the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]
