"""Offload tiers for idle chains: what a chain is to the tier stack.

When the pool needs room, `ChainCache.make_room` hands an idle chain to `offload`: the
stack copies its K/V rows (every layer, in view order, per pool group) to host memory
or a file and the chain's slots are freed. A request that continues the chain calls
`restore`: new slots under the chain's owner id, the rows copied back in the same order,
so the restored state is bit-identical.

An entry is the owner's views in every pool group (sliding-window groups included),
named by the owner id. Its disk file records the chain's tokens under the chain id, and
the stack adds the owner's per-sequence device state (view positions, the method's
state: `chain_state.py`), so an entry is complete on its own and a later engine with
the same KV fingerprint continues the chain (`attach`). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from sparsevllm.engine.cache.chains import Chain, ChainCache
from sparsevllm.engine.cache.tiering import DISK, DiskRecord, Tiers
from sparsevllm.engine.kv_pool import KVPool


class ChainTiering:
    """The chain cache's offload callbacks over the tier stack, and the stack's
    `TierClient` (entries keyed by owner id)."""

    def __init__(self, chains: ChainCache, pool: KVPool, tiers: Tiers) -> None:
        self.chains = chains
        self.pool = pool
        self.tiers = tiers
        chains.offload = self.offload
        chains.restore = self.restore
        tiers.bind(self)

    # -- ChainCache callbacks -----------------------------------------------------------
    def offload(self, chain: Chain) -> str | None:
        owner = chain.owner
        if not self.pool.has(owner):
            return None
        slots = [self.pool.table(owner, g) for g in range(self.pool.num_groups)]
        tier = self.tiers.offload(owner, slots)
        if tier is not None:
            self.pool.release(owner)
        return tier

    def restore(self, chain: Chain) -> bool:
        return self.tiers.restore(chain.owner) is not None

    # -- TierClient ---------------------------------------------------------------------
    def describe(self, key: int) -> DiskRecord:
        chain = self._chain(key)
        return DiskRecord(chain.chain_id, list(chain.tokens), {"method": chain.method})

    def allocate(self, key: int, counts: list[int]) -> list[list[int]]:
        self.pool.append_per_group(key, counts)
        return [self.pool.table(key, g) for g in range(self.pool.num_groups)]

    def moved(self, key: int, tier: str) -> None:
        self._chain(key).tier = tier

    def discard(self, key: int) -> None:
        self.chains.drop_owner(key)

    def _chain(self, owner: int) -> Chain:
        chain = self.chains.by_owner(owner)
        if chain is None:
            raise KeyError(f"no chain is stored under owner {owner}")
        return chain

    # -- restarts -----------------------------------------------------------------------
    def attach(self, new_owner: Callable[[], int]) -> int:
        """Register the chains an earlier engine left on disk (oldest first), each under
        a new owner id; returns how many."""
        saved = self.tiers.scan()
        for entry in saved:
            owner = new_owner()
            self.tiers.register(owner, entry)
            main = entry.counts[: self.pool.num_main_groups]
            method = entry.meta.get("method")
            method = method if isinstance(method, str) else None
            self.chains.adopt(entry.name, owner, entry.tokens, main, DISK, method)
        return len(saved)
