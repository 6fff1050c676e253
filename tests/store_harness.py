"""A miniature engine around one prefix store, for the property tests of the protocol
(tests/engine/test_store_properties.py).

It plays the scheduler and the engine with a real `KVPool`, a real tier stack over tiny
K/V tensors and the store under test, through the `PrefixStore` verbs only. Computing a
token writes `encode(position, token)` into every layer's K row of its slot (and the
negation into V), so that KV read back from any cache or tier shows which token and
position it holds.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from dataclasses import dataclass, field

import torch

from sparsevllm.engine.cache.chain_store import ChainStore
from sparsevllm.engine.cache.disk_tier import DiskTier
from sparsevllm.engine.cache.host_tier import HostTier
from sparsevllm.engine.cache.kv_rows import KVRows, StatePayload
from sparsevllm.engine.cache.radix_store import RadixStore
from sparsevllm.engine.cache.store import PrefixStore, PruneSpec
from sparsevllm.engine.cache.tier_stack import TierStack
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.sequence import Sequence
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sampling import SamplingParams

NUM_SLOTS = 24
NUM_LAYERS = 2
ROW_BYTES = 4 * 2  # one float32 K and V per layer and slot


def encode(position: int, token: int) -> float:
    return float(position * 16 + token)


class FakePruner:
    """`KVPruner` that keeps, per range, the newest ceil(keep_ratio x n) entries."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool

    def check_shared(self) -> None:
        pass

    def keep_shared(self, slots: list[int], positions: list[int], spec: PruneSpec) -> list[int]:
        dropped: set[int] = set()
        for start, end in spec.ranges:
            inside = [i for i, p in enumerate(positions) if start <= p < end]
            kept = math.ceil(spec.keep_ratio * len(inside) - 1e-9)
            dropped.update(inside[: len(inside) - kept])
        return [i for i in range(len(slots)) if i not in dropped]

    def prune_views(self, owner: int, spec: PruneSpec) -> None:
        for g in range(self.pool.num_main_groups):
            n = self.pool.num_resident(owner, g)
            kept = math.ceil(spec.keep_ratio * n - 1e-9)
            self.pool.replace_view(owner, g, list(range(n - kept, n)))


class FakeState:
    """Per-sequence method state: `EntryState` of the tier stack, and what the engine's
    runner keeps and releases per sequence."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # owner -> a marker of its state

    def export(self, key: int) -> StatePayload:
        return {"marker": self.held[key]}

    def load(self, key: int, state: StatePayload) -> None:
        marker = state["marker"]
        assert isinstance(marker, int)
        self.held[key] = marker

    def release(self, key: int) -> None:
        self.held.pop(key, None)


@dataclass
class World:
    """One store with its pool, KV tensors and tiers; `tiers` is "none", "cpu" or
    "cpu+disk"."""

    kind: str  # "radix" or "chain"
    tiers: str
    directory: str | None = None
    ids: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if self.tiers == "cpu+disk" and self.directory is None:
            self._tmp = tempfile.TemporaryDirectory()
            self.directory = self._tmp.name
        self.build()

    def build(self) -> None:
        """A fresh engine (pool, KV, store) over the same disk directory."""
        groups = [[0, 1]] if self.kind == "radix" else [[0], [1]]
        self.pool = KVPool(NUM_SLOTS, NUM_LAYERS, groups)
        self.k = [torch.zeros(NUM_SLOTS, 1, 1) for _ in range(NUM_LAYERS)]
        self.v = [torch.zeros(NUM_SLOTS, 1, 1) for _ in range(NUM_LAYERS)]
        self.state = FakeState()
        self.stack = self._stack()
        pruner = FakePruner(self.pool)
        self.store: PrefixStore
        if self.kind == "radix":
            self.store = RadixStore(self.pool, pruner, self.stack)
        else:
            self.store = ChainStore(
                self.pool, pruner, self.state.release, lambda: next(self.ids), self.stack
            )
        self.pool.reclaimer = self.store
        self.store.attach()

    def _stack(self) -> TierStack | None:
        if self.tiers == "none":
            return None
        cpu = HostTier(10 * NUM_LAYERS * ROW_BYTES)  # ten slots of every layer
        disk = None
        if self.directory is not None:
            disk = DiskTier(self.directory, 12_000, {"test": "store", "cache": self.kind})
        kv = KVRows(
            [DenseStorage.wrap(k, v) for k, v in zip(self.k, self.v)], self.pool.group_of_layer
        )
        state = self.state if self.kind == "chain" else None
        return TierStack(self.pool, kv, cpu, disk, state)

    def close(self) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()

    # -- KV values ----------------------------------------------------------------------
    def write(self, seq: Sequence, start: int, n: int) -> None:
        """Compute tokens start..start+n of `seq`: the newest n entries of each view."""
        tokens = seq.token_ids
        for layer in range(NUM_LAYERS):
            view = self.pool.table(seq.seq_id, self.pool.group_of_layer[layer])
            for slot, pos in zip(view[len(view) - n :], range(start, start + n)):
                self.k[layer][slot] = encode(pos, tokens[pos])
                self.v[layer][slot] = -encode(pos, tokens[pos])

    def values(self, owner: int) -> list[list[float]]:
        """K values of `owner`'s views, per layer (V checked against them)."""
        out = []
        for layer in range(NUM_LAYERS):
            view = self.pool.table(owner, self.pool.group_of_layer[layer])
            k = [float(self.k[layer][s]) for s in view]
            assert [-float(self.v[layer][s]) for s in view] == k
            out.append(k)
        return out


class Engine:
    """The scheduler's and the engine's use of the store, one verb at a time."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.histories: list[list[int]] = [[1, 2, 3, 1, 2], [2, 2, 1]]
        self.snapshots: dict[int, list[list[float]]] = {}  # idle chain owner -> its KV

    @property
    def store(self) -> PrefixStore:
        return self.world.store

    @property
    def pool(self) -> KVPool:
        return self.world.pool

    def add(self, prompt: list[int], chain_id: str | None) -> Sequence:
        """`LLMEngine.add_request`: ChainBusyError propagates, nothing is queued."""
        claim = self.store.claim(prompt, chain_id)
        seq_id = claim.owner if claim.owner is not None else next(self.world.ids)
        seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=8))
        seq.chain_id, seq.chain_status = claim.chain_id, claim.status
        if claim.cached_tokens:  # a continued chain: its KV and state are back, unchanged
            seq.num_computed_tokens = claim.cached_tokens
            assert self.world.values(seq_id) == self.snapshots.pop(seq_id)
            assert seq_id in self.world.state.held
        self.waiting.append(seq)
        return seq

    def admit(self, seq: Sequence, token: int) -> bool:
        """`Scheduler._admit_waiting` for `seq`, then its prefill step."""
        cached = 0
        if not self.pool.has(seq.seq_id):
            cached = self.store.match_and_lock(seq, 1 + len(self.running))
            seq.num_computed_tokens = cached
        need = seq.num_uncomputed_tokens
        if not self.pool.can_append(need + len(self.running)):
            if cached:
                self._release(seq)
                seq.num_computed_tokens = 0
            return False
        self.waiting.remove(seq)
        self.running.append(seq)
        self.world.state.held.setdefault(seq.seq_id, seq.seq_id)
        self.pool.append(seq.seq_id, need)
        self.world.write(seq, seq.num_computed_tokens, need)
        seq.num_computed_tokens = seq.num_tokens
        seq.output_token_ids.append(token)
        return True

    def decode(self, seq: Sequence, token: int) -> None:
        # Only a running sequence decodes (a preempted one holds no slots until admitted).
        assert seq in self.running, f"sequence {seq.seq_id} decodes while not running"
        if not self.pool.can_append(1):
            return self.preempt(seq)
        self.pool.append(seq.seq_id, 1)
        self.world.write(seq, seq.num_computed_tokens, 1)
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(token)

    def evict(self, seq: Sequence, group: int, keep_every: int) -> None:
        """A sparse method dropping entries of a running chain-store sequence's view."""
        n = self.pool.num_resident(seq.seq_id, group)
        keep = [i for i in range(n) if i % keep_every or i == n - 1]
        self.pool.replace_view(seq.seq_id, group, keep)

    def finish(self, seq: Sequence) -> None:
        """`Scheduler.finish` for a normal end, then the engine forgetting `seq`."""
        self.running.remove(seq)
        self.histories.append(seq.token_slice(0, seq.num_computed_tokens))
        if self.store.finish(seq):
            self.snapshots[seq.seq_id] = self.world.values(seq.seq_id)
        else:  # the store kept slots at most: the method's state goes
            self.world.state.release(seq.seq_id)

    def abort(self, seq: Sequence) -> None:
        (self.running if seq in self.running else self.waiting).remove(seq)
        self._release(seq)
        self.world.state.release(seq.seq_id)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.world.state.release(seq.seq_id)
        seq.num_computed_tokens = 0
        self.waiting.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.seq_id)
        self.store.release(seq)
