"""Which replica serves a request: affinity to the replica that holds its state, with
bounded imbalance, and the least loaded replica otherwise. Pure Python (no Ray), shared
by the ingress and the Ray Serve router of one process (`shared_policy`).

A request's *holders* are, in order: the replica its `chain_id` last ran on, the
replica whose id prefixes its `previous_response_id` (`resp_<replica>_...`), or the
replicas that hold the deepest of its prompt-prefix blocks (when they cover at least
`min_prefix_fraction` of them). Among holders, two random ones are compared (power of
two choices) and the less loaded is taken, unless it has more than `max_imbalance`
requests in flight above the least loaded replica: then the request goes to the least
loaded one ("overloaded"). Without holders it goes to the least loaded replica (ties:
the one routed to least often).

All of it is soft state, bounded by `capacity` keys (least recently used dropped first):
losing it costs cache hits, never correctness, because every request carries what a
replica needs to serve it from scratch. The one exception is a chain on a replica known
to be dead: `lost_key` names it, and the ingress answers 410 `chain_lost`.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from sparsevllm.server.replicas.keys import RouteHint
from sparsevllm.server.replicas.options import RouteOptions

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# Outcomes counted per routed request (the router's hit/miss counters).
OUTCOMES = ("hit", "miss", "overloaded", "random", "target", "lost")
RESPONSE_ID_PREFIX = "resp_"
# A RouteHint target meaning "any replica" (a call about the replicas, not a request).
ANY_REPLICA = "*"


class LRU(Generic[K, V]):
    """A dict of at most `capacity` entries; reads and writes make an entry recent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


def response_id_prefix(replica_id: str) -> str:
    """What a replica puts after `resp_` in its response ids (so the router knows, with
    no state, which replica stores a `previous_response_id`)."""
    return f"{replica_id}_"


def response_owner(response_id: str) -> str | None:
    """The replica id inside `resp_<replica>_<hex>`; None for ids of another form."""
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    owner, sep, rest = response_id[len(RESPONSE_ID_PREFIX) :].partition("_")
    return owner if sep and owner and rest else None


class RoutingPolicy:
    """The routing state of one deployment's replicas (thread-safe: the Ray router runs
    on its own event loop thread, the ingress on another)."""

    def __init__(self, options: RouteOptions | None = None, seed: int | None = None) -> None:
        self.options = options or RouteOptions()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._live: list[str] = []
        self._dead: LRU[str, bool] = LRU(1024)
        self._chains: LRU[str, str] = LRU(self.options.capacity)
        self._blocks: LRU[int, set[str]] = LRU(self.options.capacity)
        self._in_flight: dict[str, int] = {}
        self._routed: dict[str, int] = {}
        self._requests: dict[str, str] = {}  # request key -> replica, while in flight
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    # -- replicas ------------------------------------------------------------------------
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """The running replicas; any that left are dead (their chains are lost)."""
        ids = list(dict.fromkeys(replica_ids))
        with self._lock:
            for gone in set(self._live) - set(ids):
                self._dead.put(gone, True)
            self._live = [r for r in ids if self._dead.get(r) is None]

    def mark_dead(self, replica_id: str) -> None:
        """A replica whose calls failed as dead: routed nowhere, its chains lost."""
        with self._lock:
            self._dead.put(replica_id, True)
            self._live = [r for r in self._live if r != replica_id]

    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def is_dead(self, replica_id: str) -> bool:
        with self._lock:
            return self._dead.get(replica_id) is not None

    def load(self, replica_id: str) -> int:
        with self._lock:
            return self._in_flight.get(replica_id, 0)

    # -- choosing ------------------------------------------------------------------------
    def lost_key(self, hint: RouteHint) -> tuple[str, str] | None:
        """(param, key) of the chain `hint` continues if it lived on a dead replica:
        a named chain last run there, or a previous response stored there."""
        with self._lock:
            if hint.chain_id is not None:
                owner = self._chains.get(hint.chain_id)
                if owner is not None and self._dead.get(owner) is not None:
                    return ("chain_id", hint.chain_id)
            if hint.previous_response_id is not None:
                owner = response_owner(hint.previous_response_id)
                if owner is not None and self._live and owner not in self._live:
                    return ("previous_response_id", hint.previous_response_id)
        return None

    def forget_chain(self, chain_id: str) -> None:
        with self._lock:
            self._chains.pop(chain_id)

    def choose(self, hint: RouteHint, candidates: list[str]) -> list[str]:
        """Candidates ranked best first; sets `hint.decision` (an OUTCOMES entry)."""
        with self._lock:
            live = [c for c in candidates if c not in hint.exclude and self._dead.get(c) is None]
            if hint.target is not None:
                hint.decision = "target"
                if hint.target == ANY_REPLICA:
                    return list(candidates)
                return [hint.target] if hint.target in candidates else []
            if not live:
                live = [c for c in candidates if c not in hint.exclude] or list(candidates)
            if self.options.random:
                hint.decision = "random"
                return self._rng.sample(live, len(live))
            ranked = self._by_load(live)
            holders = self._holders(hint, live)
            if not holders:
                hint.decision = "miss"
                return ranked
            pick = self._two_choices(holders)
            least = self._in_flight.get(ranked[0], 0)
            if self._in_flight.get(pick, 0) > least + self.options.max_imbalance:
                hint.decision = "overloaded"
                return ranked
            hint.decision = "hit"
            return [pick, *(r for r in ranked if r != pick)]

    def _by_load(self, replica_ids: list[str]) -> list[str]:
        jitter = {r: self._rng.random() for r in replica_ids}
        return sorted(
            replica_ids,
            key=lambda r: (self._in_flight.get(r, 0), self._routed.get(r, 0), jitter[r]),
        )

    def _two_choices(self, holders: list[str]) -> str:
        if len(holders) == 1:
            return holders[0]
        a, b = self._rng.sample(holders, 2)
        return a if self._in_flight.get(a, 0) <= self._in_flight.get(b, 0) else b

    def _holders(self, hint: RouteHint, live: list[str]) -> list[str]:
        """The live replicas holding the request's chain, response or prompt prefix."""
        if hint.chain_id is not None:
            owner = self._chains.get(hint.chain_id)
            if owner in live:
                return [owner]
        if hint.previous_response_id is not None:
            owner = response_owner(hint.previous_response_id)
            if owner in live:
                return [owner]
        return self._prefix_holders(hint.prefix, live)

    def _prefix_holders(self, prefix: tuple[int, ...], live: list[str]) -> list[str]:
        least = max(1, int(self.options.min_prefix_fraction * len(prefix) + 0.999999))
        for depth in range(len(prefix), least - 1, -1):
            held = self._blocks.get(prefix[depth - 1])
            holders = [r for r in live if held is not None and r in held]
            if holders:
                return holders
        return []

    # -- bookkeeping ---------------------------------------------------------------------
    def routed(self, hint: RouteHint, replica_id: str, request_key: str) -> None:
        """A call went to `replica_id`: count it, hold its load, learn its keys (again
        for the same call: moved there, counted once)."""
        with self._lock:
            hint.chosen = replica_id
            before = self._requests.get(request_key)
            if before == replica_id:
                return  # the router may report a routing twice
            if before is None:
                self.counts[hint.decision or "miss"] += 1
            else:  # routed again (the first choice turned it away)
                self._in_flight[before] = max(0, self._in_flight.get(before, 1) - 1)
            self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
            self._routed[replica_id] = self._routed.get(replica_id, 0) + 1
            self._requests[request_key] = replica_id
            if hint.target is None:
                if hint.chain_id is not None:
                    self._chains.put(hint.chain_id, replica_id)
                self._record(replica_id, hint.prefix)

    def completed(self, request_key: str) -> None:
        """The call `request_key` ended (however); a second report is a no-op."""
        with self._lock:
            replica_id = self._requests.pop(request_key, None)
            if replica_id is not None:
                self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 1) - 1)

    def record_prefix(self, replica_id: str, prefix: tuple[int, ...]) -> None:
        """`replica_id` now holds these prefix blocks (e.g. a prompt and its reply)."""
        with self._lock:
            self._record(replica_id, prefix)

    def _record(self, replica_id: str, prefix: tuple[int, ...]) -> None:
        for block in prefix:
            held = self._blocks.get(block)
            if held is None:
                self._blocks.put(block, {replica_id})
            else:
                held.add(replica_id)

    def count_lost(self) -> None:
        with self._lock:
            self.counts["lost"] += 1

    def snapshot(self) -> dict[str, int]:
        """The outcome counters, and the keys remembered."""
        with self._lock:
            return {**self.counts, "chains": len(self._chains), "blocks": len(self._blocks)}


_SHARED: dict[str, RoutingPolicy] = {}
_SHARED_LOCK = threading.Lock()


def shared_policy(name: str, options: RouteOptions | None = None) -> RoutingPolicy:
    """The process's policy called `name`, made on first use (the ingress and the Ray
    router of a process find each other's through it)."""
    with _SHARED_LOCK:
        policy = _SHARED.get(name)
        if policy is None:
            policy = _SHARED[name] = RoutingPolicy(options)
        return policy
