"""Chains: conversations continue from an eviction method's resident state.

A prefix cache cannot serve eviction methods: the KV they keep is no longer a plain
prefix. Instead, when a turn ends its whole sequence state stays resident as an idle
*chain*: the logical tokens it has processed, the retained KV (the pool's slot tables
of its owner sequence id) and the method's own state (kept by the method under the same
id). A new request whose tokens start with a chain's tokens continues from that state
and prefills only its new suffix. This module keeps the chains' bookkeeping (lookup,
one writer per chain, least-recently-used reclaim); the chain store (`chain_store.py`)
supplies `on_drop`, which frees a dropped chain's slots and method state, and the
offload callbacks. Pure Python.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from sparsevllm.engine.cache.store import ChainBusyError, ChainRow


@dataclass
class Chain:
    chain_id: str
    owner: int  # sequence id under which the pool and the method keep the state
    tokens: list[int]  # logical tokens the state covers
    resident: int  # slots it holds (fullest layer group), as listings report it
    # Slots dropping it frees in every main layer group (its emptiest one): what the
    # pool may count on, since it is as full as its fullest group.
    reclaim: int
    busy: bool = False
    last_used: int = 0
    # The sparse-method choice (`MethodChoice.key`) whose state it is; a request of
    # another choice does not continue it. None: the engine's only method.
    method: str | None = None
    tier: str | None = None  # "CPU" or "disk": its KV lives in that tier; no slots held

    @property
    def offloaded(self) -> bool:
        return self.tier is not None


class ChainCache:
    """Idle and busy chains by id; `on_drop(owner)` frees what a dropped chain held."""

    def __init__(
        self,
        on_drop: Callable[[int], None],
        offload: Callable[[Chain], str | None] | None = None,
        restore: Callable[[Chain], bool] | None = None,
    ) -> None:
        """`offload(chain)` moves a chain's KV to an offload tier and names it (None: no
        room) and `restore(chain)` brings it back (False: the pool has no room)."""
        self.on_drop = on_drop
        self.offload = offload
        self.restore = restore
        self.chains: dict[str, Chain] = {}
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        while True:  # chains restored from disk keep the ids an earlier engine gave them
            chain_id = f"chain-{next(self._ids)}"
            if chain_id not in self.chains:
                return chain_id

    # -- lookup -------------------------------------------------------------------------
    def acquire(
        self, tokens: list[int], chain_id: str | None, method: str | None = None
    ) -> tuple[Chain | None, str]:
        """Find the chain a request of method choice `method` continues and mark it busy.

        Returns (chain or None, status). Status is `continued`, `new`, `not_found` (an
        explicit id that is unknown, e.g. reclaimed) or `diverged: ...` (the explicit
        chain was dropped because the request does not extend its tokens). A named chain
        of another method choice raises ValueError (it stays as it is).
        """
        if chain_id is None:
            chain = self._longest_idle_prefix(tokens, method)
            if chain is None:
                return None, "new"
        else:
            chain = self.chains.get(chain_id)
            if chain is None:
                return None, "not_found"
            if chain.busy:
                raise ChainBusyError(f"chain {chain_id!r} is busy: another request is extending it")
            if chain.method != method:
                raise ValueError(
                    f"chain {chain_id!r} holds the state of another sparse method choice "
                    f"({chain.method}); continue it with that method and settings, or "
                    "start a new chain"
                )
            at = _divergence(chain.tokens, tokens)
            if at is not None:
                self.drop(chain)
                return None, (
                    f"diverged: the request differs from chain {chain_id!r} at token {at} "
                    f"of {len(chain.tokens)}; the chain was dropped and the request starts fresh"
                )
        status = "continued"
        if chain.offloaded:
            tier = chain.tier
            if not self.bring_back(chain):
                self.drop(chain)
                return None, "dropped: no room to restore the offloaded chain"
            status = f"continued (restored from {tier})"
        chain.busy = True
        chain.last_used = next(self._clock)
        return chain, status

    def bring_back(self, chain: Chain) -> bool:
        """Make an offloaded chain's KV resident again; False (still offloaded) if the
        pool has no room."""
        if chain.offloaded:
            if self.restore is None or not self.restore(chain):
                return False
            chain.tier = None
        return True

    def _longest_idle_prefix(self, tokens: list[int], method: str | None) -> Chain | None:
        best = None
        for chain in self.chains.values():
            if chain.busy or chain.method != method:
                continue
            if _divergence(chain.tokens, tokens) is not None:
                continue
            if best is None or len(chain.tokens) > len(best.tokens):
                best = chain
        return best

    # -- life cycle ---------------------------------------------------------------------
    def park(
        self,
        chain_id: str,
        owner: int,
        tokens: list[int],
        resident: int,
        reclaim: int,
        method: str | None = None,
    ) -> bool:
        """A turn ended: keep its state as the idle chain `chain_id`, replacing an idle
        chain of that id. False (nothing kept) when another running request extends a
        chain of that id: one writer per chain, and that one came first."""
        old = self.chains.get(chain_id)
        if old is not None and old.owner != owner:
            if old.busy:
                return False
            self.drop(old)
        self.chains[chain_id] = Chain(
            chain_id,
            owner,
            list(tokens),
            resident,
            reclaim,
            last_used=next(self._clock),
            method=method,
        )
        return True

    def adopt(
        self,
        chain_id: str,
        owner: int,
        tokens: list[int],
        counts: list[int],
        tier: str,
        method: str | None = None,
    ) -> None:
        """Register an offloaded chain saved by an earlier engine (newest last);
        `counts`: its rows per main layer group."""
        self.chains[chain_id] = Chain(
            chain_id,
            owner,
            list(tokens),
            max(counts),
            min(counts),
            last_used=next(self._clock),
            tier=tier,
            method=method,
        )

    def add_copy(self, chain: Chain, owner: int) -> Chain:
        """Register a copy of `chain` whose state the pool and the method keep under
        `owner`, under a new id (`PrefixStore.clone`); busy, so neither reclaimed nor
        offloaded, until the caller marks it idle."""
        copy = Chain(
            self.new_id(),
            owner,
            list(chain.tokens),
            chain.resident,
            chain.reclaim,
            busy=True,
            last_used=next(self._clock),
            method=chain.method,
        )
        self.chains[copy.chain_id] = copy
        return copy

    def by_owner(self, owner: int) -> Chain | None:
        return next((c for c in self.chains.values() if c.owner == owner), None)

    def drop_owner(self, owner: int) -> None:
        """An offload tier gave up the chain stored under `owner` (to make room)."""
        chain = self.by_owner(owner)
        if chain is not None:
            self.drop(chain)

    def forget(self, chain_id: str | None, owner: int) -> None:
        """The running request `owner` of chain `chain_id` was aborted or preempted: the
        chain's state, which it had taken over, is gone. (A chain of that id parked
        meanwhile by another request keeps its own state.)"""
        chain = self.chains.get(chain_id) if chain_id is not None else None
        if chain is not None and chain.owner == owner:
            del self.chains[chain.chain_id]

    def drop(self, chain: Chain) -> None:
        self.chains.pop(chain.chain_id, None)
        self.on_drop(chain.owner)

    # -- memory pressure ----------------------------------------------------------------
    @property
    def reclaimable_slots(self) -> int:
        """Free slots every main group would gain if all idle resident chains went."""
        return sum(c.reclaim for c in self.idle_resident())

    @property
    def cached_slots(self) -> int:
        """Slots the idle resident chains hold (fullest layer group of each)."""
        return sum(c.resident for c in self.idle_resident())

    def idle_resident(self) -> list[Chain]:
        return [c for c in self.chains.values() if not (c.busy or c.offloaded)]

    def make_room(self, n: int) -> None:
        """Offload or drop idle chains, least recently used first, until every main
        layer group gained `n` free slots (or none is left)."""
        freed = 0
        for chain in sorted(self.idle_resident(), key=lambda c: c.last_used):
            if freed >= n:
                break
            tier = self.offload(chain) if self.offload is not None else None
            if tier is not None:
                chain.tier = tier
            else:
                self.drop(chain)
            freed += chain.reclaim

    def listing(self) -> list[ChainRow]:
        return [
            {
                "chain_id": c.chain_id,
                "logical_tokens": len(c.tokens),
                "resident_slots": 0 if c.offloaded else c.resident,
                "busy": c.busy,
                "offloaded": c.offloaded,
                "tier": c.tier,
            }
            for c in self.chains.values()
        ]


def _divergence(chain_tokens: list[int], tokens: list[int]) -> int | None:
    """First index where `tokens` stops extending `chain_tokens` (None: it extends them
    with at least one new token)."""
    for i, t in enumerate(chain_tokens):
        if i >= len(tokens) or tokens[i] != t:
            return i
    return None if len(tokens) > len(chain_tokens) else len(tokens)
