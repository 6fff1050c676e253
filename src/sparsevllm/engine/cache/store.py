"""The prefix-store protocol: the one interface through which the engine and the
scheduler use cross-request KV state.

Two stores implement it (docs/caching.md): the radix prefix cache
(`radix_store.RadixStore`: shared token prefixes, for storage that stays a plain
prefix) and the chain cache (`chain_store.ChainStore`: a finished turn's whole resident
state, for eviction methods). The engine builds one of them (`build.build_store`) and
hands it to the scheduler; neither asks which one it holds.

The life of a request, as a store sees it:

1. `claim` when the request is added: a store that continues a named conversation
   finds it here, so that a conflict (`ChainBusyError`) reaches the caller at once;
2. `match_and_lock` when the scheduler admits it: the store lends the KV of a cached
   prefix and keeps it from being evicted while the request reads it;
3. `finish` (its KV is handed to the store) or `release` (it will not be cached: an
   abort, a preemption, an error).

Between requests the pool asks for room (`reclaimable_slots`, `make_room`), and callers
prune (`prune`), list (`listing`), copy an entry into slots of its own (`clone`: the
throughput benchmark's decode-capacity mode), and save the state to the disk tier at
shutdown (`persist`) for a later engine to pick up (`attach`).

Pure Python, like the scheduler: this module never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Protocol, TypedDict

from sparsevllm.engine.sequence import Sequence


class ChainBusyError(ValueError):
    """A cached entry is in use (a running request extends the chain, or reads the
    prefix), or cannot be brought back into the pool now (HTTP 409)."""


class CacheEntryNotFound(LookupError):
    """The chain or cached prefix to prune does not exist (HTTP 404)."""


@dataclass(frozen=True)
class Claim:
    """What a store says about a request when it is added (`PrefixStore.claim`)."""

    owner: int | None = None  # the sequence id whose state the request continues
    chain_id: str | None = None  # the conversation it belongs to (None: the store has none)
    status: str | None = None  # how it was found: continued, new, not_found, diverged...
    cached_tokens: int = 0  # logical tokens whose KV it already has


NO_CLAIM = Claim()


@dataclass(frozen=True)
class PruneSpec:
    """Which logical token ranges of a cached history to compress, and how."""

    ranges: list[tuple[int, int]]  # sorted, not overlapping, `[start, end)`
    method: str  # the scoring rule (`engine/prune_select.py`)
    keep_ratio: float  # each range keeps ceil(keep_ratio x its resident tokens)

    def check_within(self, length: int, what: str) -> None:
        """Raise ValueError unless every range lies within the `length` cached tokens."""
        start, end = self.ranges[-1]
        if end > length:
            raise ValueError(
                f"range [{start}, {end}) ends past the {length} cached tokens of {what}"
            )


@dataclass(frozen=True)
class PruneTarget:
    """The history to prune (or to copy, `PrefixStore.clone`): a chain by id, or the
    cached history of `tokens`."""

    chain_id: str | None = None
    tokens: list[int] | None = None


@dataclass(frozen=True)
class PruneResult:
    kind: str  # "chain" or "prefix"
    chain_id: str | None
    logical_tokens: int  # the cached history's length (unchanged by pruning)
    resident_before: int  # KV slots per layer it held (fullest layer group)
    resident_after: int
    method: str
    keep_ratio: float
    ranges: list[tuple[int, int]]

    @property
    def slots_freed(self) -> int:
        return self.resident_before - self.resident_after

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = asdict(self)
        out["ranges"] = [list(r) for r in self.ranges]
        out["slots_freed"] = self.slots_freed
        return out


@dataclass(frozen=True)
class CachedCopy:
    """A copy of a cached history (`PrefixStore.clone`), in KV slots of its own: a request
    whose prompt extends `tokens` (naming `chain_id`, where the store names entries)
    continues it exactly as it would continue the original."""

    tokens: list[int]
    chain_id: str | None


class RowCopier(Protocol):
    """The KV side of `PrefixStore.clone` (torch: `kv_rows.KVRows.copy`)."""

    def copy(self, src: list[list[int]], dst: list[list[int]]) -> None:
        """Write every layer's rows at its group's `src[g]` slots to the `dst[g]` slots
        (as many, in order), on the device, every buffer in the stored form."""


class StateCopier(Protocol):
    """Per-sequence device state besides the KV rows, for `PrefixStore.clone` of a chain
    (torch: `chain_state.ChainDeviceState.copy`)."""

    def copy(self, src: int, dst: int) -> None:
        """Give sequence `dst` a copy of `src`'s state (view positions, method choice,
        the method's per-sequence state), in tensors of its own."""


class KVPruner(Protocol):
    """The KV side of pruning, which the stores call from `prune` (the runner's
    implementation scores keys with torch: `engine/prune.py`)."""

    def check_shared(self) -> None:
        """Raise ValueError if a view that every layer shares cannot be pruned here."""

    def keep_shared(self, slots: list[int], positions: list[int], spec: PruneSpec) -> list[int]:
        """Indices into `slots` to keep: one selection for every layer and head of a
        view all layers share; `positions` holds each slot's logical token position."""

    def prune_views(self, owner: int, spec: PruneSpec) -> None:
        """Compress the views `owner` holds in the pool in place (per KV head where its
        storage has one layer per group), freeing the dropped slots."""


# -- listings (GET /v1/cache) and statistics --------------------------------------------
class ChainRow(TypedDict):
    chain_id: str
    logical_tokens: int
    resident_slots: int
    busy: bool
    offloaded: bool
    tier: str | None


class PrefixRow(TypedDict):
    tokens: int  # the name of the logical length before pruning existed
    logical_tokens: int
    resident_slots: int


class OffloadedRow(TypedDict):
    tier: str
    start: int
    logical_tokens: int
    tokens: int
    rows: int
    bytes: int


class OffloadUsage(TypedDict):
    cpu_bytes: int
    cpu_capacity_bytes: int
    disk_bytes: int
    disk_capacity_bytes: int
    num_offloaded: int
    num_restored: int


class _ListingBase(TypedDict):
    mode: str  # "radix", "chain" or "off"
    chains: list[ChainRow]
    prefixes: list[PrefixRow]
    kv_slots_cached: int


class CacheListing(_ListingBase, total=False):
    offload: OffloadUsage  # with offload tiers
    offloaded: list[OffloadedRow]  # radix nodes held by a tier


def empty_listing() -> CacheListing:
    """The listing of an engine without prefix caching."""
    return {"mode": "off", "chains": [], "prefixes": [], "kv_slots_cached": 0}


class StoreStats(TypedDict):
    kv_slots_cached: int
    num_idle_chains: int
    num_kv_offloaded: int
    num_kv_restored: int
    kv_offload_cpu_bytes: int
    kv_offload_disk_bytes: int


def store_stats(cached: int, idle_chains: int = 0, usage: OffloadUsage | None = None) -> StoreStats:
    """Engine statistics of a store (all zeros: no store)."""
    return {
        "kv_slots_cached": cached,
        "num_idle_chains": idle_chains,
        "num_kv_offloaded": usage["num_offloaded"] if usage else 0,
        "num_kv_restored": usage["num_restored"] if usage else 0,
        "kv_offload_cpu_bytes": usage["cpu_bytes"] if usage else 0,
        "kv_offload_disk_bytes": usage["disk_bytes"] if usage else 0,
    }


class PrefixStore(Protocol):
    """Cross-request KV state: the radix prefix cache or the chain cache.

    A store keeps KV slots of the engine's pool after their requests end, and lends them
    to later requests. Every slot it holds is either lent to a running request (locked:
    never evicted) or reclaimable: the pool takes reclaimable slots back through
    `make_room` before it preempts anything.
    """

    parks_views: bool
    """True when `finish` keeps the finished sequence's own views, every pool group
    included (sliding-window groups too): then a step scheduled ahead must not trim a
    view the store is about to keep."""

    def claim(self, tokens: list[int], chain_id: str | None, method: str | None = None) -> Claim:
        """A request with prompt `tokens` is being added (optionally naming the chain
        `chain_id` it continues), served by the sparse-method choice `method`
        (`MethodChoice.key`; state built by another choice is not continued). Returns
        what it continues: the sequence id to run it under (`owner`, whose state it takes
        over), its chain and status, and how many tokens are cached. Raises
        ChainBusyError when the named state is in use, ValueError when it was built by
        another method choice. A store without named state returns `NO_CLAIM`."""

    def match_and_lock(self, seq: Sequence, reserve: int) -> int:
        """The scheduler admits `seq`, which holds no KV yet: lend it the longest cached
        prefix of its tokens (all but the last), attached as the start of its pool view,
        and lock that prefix until `finish` or `release`. Offloaded state is brought
        back only while the pool keeps `reserve` slots besides. Returns the number of
        logical tokens lent (0: nothing); the caller sets `seq.num_computed_tokens`."""

    def finish(self, seq: Sequence) -> bool:
        """`seq` ended normally and holds its KV in the pool: take that KV over (the
        pool no longer owns it) and unlock what it borrowed. Returns True when the store
        keeps the sequence's own state under its id (the method's per-sequence state
        must then stay), False when only KV slots were kept."""

    def release(self, seq: Sequence) -> None:
        """`seq` will not be cached, or not now: an abort, a preemption, an error, or an
        admission put off after `match_and_lock`. The pool has freed its own slots.
        Unlock what it borrowed, and forget state it took over (a claimed chain's state
        was the sequence's own, and is gone with it)."""

    @property
    def reclaimable_slots(self) -> int:
        """Slots `make_room` could give back to the pool now (nothing locked)."""

    def make_room(self, n: int) -> None:
        """Give at least `n` slots back to the pool if possible: evict or offload
        unlocked entries, least recently used first."""

    def prune(self, target: PruneTarget, spec: PruneSpec) -> PruneResult:
        """Compress `spec.ranges` of the cached history `target` names, freeing the
        dropped slots at once; the history stays matchable for its whole length. Raises
        ValueError (a bad target or range), CacheEntryNotFound, or ChainBusyError (in
        use, or offloaded with no room to bring it back)."""

    def clone(
        self, target: PruneTarget, count: int, first_tokens: Iterable[int]
    ) -> list[CachedCopy]:
        """Make `count` copies of the idle cached history `target`, each in new KV slots
        (never shared: a copy's reads touch memory of its own), with its rows copied on
        the device in the stored form and, for a chain, its per-sequence state. A store
        that names entries (chains) keeps the original's tokens under new chain ids; one
        that matches by tokens alone (radix) caches each copy under the original's tokens
        with the first replaced by an id from `first_tokens` that no cached entry starts
        with, so that no two entries share a prefix, hence a slot. Nothing is copied
        unless every copy fits: raises PoolExhausted (naming the numbers), ValueError,
        CacheEntryNotFound or ChainBusyError. For benchmarks (`bench throughput
        --decode-capacity`): the copies hold the memory real sequences would."""

    def listing(self) -> CacheListing:
        """What the store holds, for `GET /v1/cache`."""

    def stats(self) -> StoreStats:
        """Counters for `LLM.stats()`."""

    def attach(self) -> int:
        """Take over what an earlier engine with the same KV fingerprint left in the
        disk tier (called once, when the engine starts); returns how many entries."""

    def persist(self) -> int:
        """Write every unlocked entry to the disk tier (at shutdown), so that a later
        engine can `attach` it; returns how many entries were written (0: no disk)."""
