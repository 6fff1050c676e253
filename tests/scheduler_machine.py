"""A state machine over the real scheduler, KV pool, device slot tables (on the CPU) and,
optionally, the radix prefix store with its host and disk tiers.

Random sequences of add, step (schedule, then play the runner: write each computed
token's KV, sample, finish by length), abort, evict (a sparse method dropping view
entries), make_room (cache pressure), prune and persist drive them; after every rule:

- every slot of every group is free or owned exactly once (by a live sequence or the
  cache), and the owned ones are the pool's used count (free + used = total);
- every request added is waiting, running or finished, exactly one of them, and its
  status says which (none lost, none duplicated);
- a running sequence's borrowed prefix stays resident, locked, and holds the KV of its
  tokens; restored and computed KV is bit-identical to what was computed;
- the device slot tables equal the pool's tables for every running sequence;
- each step keeps the batch within max_num_seqs and max_num_batched_tokens.

Used by tests/engine/test_scheduler_machine.py (a bounded slice) and
scripts/state_machines.py (the long run).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsevllm.engine.cache.store import (
    CacheEntryNotFound,
    ChainBusyError,
    PruneSpec,
    PruneTarget,
)
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.scheduler import Scheduler
from sparsevllm.engine.sequence import SeqStatus, Sequence
from sparsevllm.engine.slot_rows import SlotRows
from sparsevllm.engine.slot_tables import DeviceSlotTables
from sparsevllm.engine.step_plan import StepPlan, plan_step
from sparsevllm.sampling import SamplingParams
from store_harness import NUM_LAYERS, NUM_SLOTS, World, encode

TOKENS = st.integers(1, 3)
INDEX = st.integers(0, 99)
MAX_NUM_SEQS = 3
MAX_BATCHED = 8
CHUNK = 4
CPU = torch.device("cpu")


class SchedulerMachine(RuleBasedStateMachine):
    """`store`: None (a dense pool with one group per layer, evicting) or "radix";
    `tiers`: the radix store's tiers ("none", "cpu", "cpu+disk")."""

    store: str | None = None
    tiers = "none"

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None
        if self.store is None:
            self.pool = KVPool(NUM_SLOTS, NUM_LAYERS, [[0], [1]])
            store = None
        else:
            self.world = World(self.store, self.tiers)
            self.pool, store = self.world.pool, self.world.store
        self.scheduler = Scheduler(self.pool, MAX_NUM_SEQS, MAX_BATCHED, CHUNK, store=store)
        self.rows = SlotRows(self.pool, 2 * MAX_NUM_SEQS + 1, NUM_SLOTS + 8)
        self.tables = DeviceSlotTables(self.pool.num_groups, self.rows.num_rows, NUM_SLOTS + 8, CPU)
        self.added: dict[str, Sequence] = {}
        self.histories: list[list[int]] = [[1, 2, 3, 1, 2], [2, 2, 1]]
        self.ids = itertools.count(10_000)  # clear of the store's own ids

    def teardown(self) -> None:
        if self.world is not None:
            self.world.close()

    # -- requests -----------------------------------------------------------------------
    @precondition(lambda self: len(self.scheduler.running) + len(self.scheduler.waiting) < 6)
    @rule(
        base=INDEX,
        cut=st.integers(0, 10),
        extra=st.lists(TOKENS, min_size=1, max_size=8),
        max_tokens=st.integers(1, 10),
    )
    def add(self, base: int, cut: int, extra: list[int], max_tokens: int) -> None:
        prompt = self.histories[base % len(self.histories)][:cut] + extra
        if len(prompt) + max_tokens > NUM_SLOTS:  # LLMEngine.validate refuses it
            return
        seq_id = next(self.ids)
        seq = Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens))
        self.added[seq.request_id] = seq
        self.scheduler.add(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(tokens=st.lists(TOKENS, min_size=MAX_NUM_SEQS, max_size=MAX_NUM_SEQS))
    def step(self, tokens: list[int]) -> None:
        """One engine step: schedule, then what the runner and postprocess do."""
        self._step(tokens)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(n=st.integers(2, 6), token=TOKENS)
    def run(self, n: int, token: int) -> None:
        """Several engine steps in a row (requests get long enough to crowd the pool)."""
        for _ in range(n):
            if self.scheduler.has_unfinished():
                self._step([token, token % 3 + 1, (token + 1) % 3 + 1])

    def _step(self, tokens: list[int]) -> None:
        out = self.scheduler.schedule()
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)) <= MAX_NUM_SEQS
        assert out.num_batched_tokens <= MAX_BATCHED
        for seq in out.preempted + out.failed:
            self.rows.release(seq.seq_id)
        sampled = 0
        for s in out.scheduled:
            assert s.start == s.seq.num_computed_tokens and s.num_new_tokens > 0
            if self.world is not None:
                self.world.write(s.seq, s.start, s.num_new_tokens)
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
        if out.scheduled:
            self._flush(plan_step(out, self.pool, self.rows))
            for seq_id in ids:  # every view of the step is whole on the device
                assert all(self.pool.is_clean(seq_id, g) for g in range(self.pool.num_groups))
        for s in out.scheduled:
            if not s.samples:
                continue
            s.seq.output_token_ids.append(tokens[sampled % len(tokens)])
            sampled += 1
            if len(s.seq.output_token_ids) >= s.seq.params.max_tokens:
                self._finish(s.seq, "length")

    def _flush(self, plan: StepPlan) -> None:
        """The device tables' update as the runner makes it: the plan's writes, then the
        entries of views that only grew, from the slot mapping."""
        self.tables.apply(plan.writes)
        if not plan.writes.deferred:
            return
        groups, num_seqs = self.pool.num_groups, plan.num_seqs
        slots, lens = torch.tensor(plan.slots), torch.tensor(plan.flat_lens)
        rows = torch.tensor(plan.rows)
        if plan.seq_major:
            mapping = slots.view(num_seqs, groups).t()
            self.tables.write_new(rows, lens.view(num_seqs, groups).t(), mapping)
        else:
            mapping = slots.view(groups, plan.num_tokens)
            q_starts = torch.tensor(plan.q_starts)
            self.tables.write_new(rows, lens.view(groups, num_seqs), mapping, q_starts)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.rows.release(seq.seq_id)
        if reason == "length":
            self.histories.append(seq.token_ids)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        live = self.scheduler.running + list(self.scheduler.waiting)
        self._finish(live[i % len(live)], "abort")

    @precondition(lambda self: self.store is None and self.scheduler.running)
    @rule(i=INDEX, group=st.integers(0, NUM_LAYERS - 1), keep_every=st.integers(2, 4))
    def evict(self, i: int, group: int, keep_every: int) -> None:
        """A sparse method dropping entries of a running sequence's view in one group."""
        seq = self.scheduler.running[i % len(self.scheduler.running)]
        n = self.pool.num_resident(seq.seq_id, group)
        keep = [j for j in range(n) if j % keep_every or j == n - 1]
        self.pool.replace_view(seq.seq_id, group, keep)  # the pool records the change

    # -- the store under pressure, pruned, saved ----------------------------------------
    @precondition(lambda self: self.world is not None)
    @rule(n=st.integers(1, NUM_SLOTS))
    def make_room(self, n: int) -> None:
        assert self.world is not None
        self.world.store.make_room(n)

    @precondition(lambda self: self.world is not None)
    @rule(
        i=INDEX,
        start=st.integers(0, 8),
        length=st.integers(1, 6),
        ratio=st.sampled_from([0.25, 0.5, 1.0]),
    )
    def prune(self, i: int, start: int, length: int, ratio: float) -> None:
        assert self.world is not None
        target = PruneTarget(tokens=self.histories[i % len(self.histories)])
        spec = PruneSpec([(start, start + length)], "fake", ratio)
        try:
            self.world.store.prune(target, spec)
        except (ValueError, CacheEntryNotFound, ChainBusyError):
            pass

    @precondition(lambda self: self.world is not None and self.tiers != "none")
    @rule()
    def persist(self) -> None:
        """Offload every unlocked cached entry (what a shutting-down server does)."""
        assert self.world is not None
        self.world.store.persist()

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def requests_accounted(self) -> None:
        waiting, running = list(self.scheduler.waiting), self.scheduler.running
        ids = [s.request_id for s in waiting + running]
        assert len(ids) == len(set(ids))  # none twice
        for request_id, seq in self.added.items():
            place = (seq in waiting) + (seq in running) + seq.is_finished
            assert place == 1, f"{request_id} is in {place} places"
            expected = {True: SeqStatus.WAITING}.get(seq in waiting)
            expected = SeqStatus.RUNNING if seq in running else expected
            assert expected is None or seq.status == expected
        assert len(running) <= MAX_NUM_SEQS

    @invariant()
    def slots_accounted(self) -> None:
        owned: list[set[int]] = [set() for _ in range(self.pool.num_groups)]
        for seq in self.scheduler.running:
            for g in range(self.pool.num_groups):
                view = self.pool.table(seq.seq_id, g)
                assert len(view) == len(set(view))
                owned[g].update(view)
            assert not self.pool.has(seq.seq_id) or seq.num_computed_tokens >= 1
        for seq in self.scheduler.waiting:
            assert not self.pool.has(seq.seq_id)  # a waiting request holds no slot
        if self.world is not None:
            cached = _cached_slots(self.world)
            assert not cached & owned[0] - _borrowed(self)  # only borrowed slots are shared
            owned[0] |= cached
        for g, slots in enumerate(owned):
            free = _free_slots(self.pool, g)
            assert len(free) == len(set(free)) and not slots & set(free)
            assert len(slots) + len(free) == self.pool.num_slots  # free + used = total
            assert len(slots) == self.pool.used_per_layer()[self.pool.layer_groups[g][0]]

    @invariant()
    def kv_and_device_tables(self) -> None:
        for seq in self.scheduler.running:
            # The device row holds what the pool's change record says it holds (an
            # eviction since the last step is flushed by the next one).
            row = self.rows.get(seq.seq_id)
            clean = self.pool.clean_prefix(seq.seq_id) if row is not None else []
            for g in range(self.pool.num_groups if row is not None else 0):
                view = self.pool.table(seq.seq_id, g)[: clean[g]]
                assert self.tables.table[g, row, : len(view)].tolist() == view
            if self.world is None:
                continue
            tokens = seq.token_ids
            want = [encode(p, tokens[p]) for p in _view_positions(self, seq)]
            assert self.world.values(seq.seq_id) == [want] * NUM_LAYERS
        if self.world is not None:
            _check_borrowed(self)


def _view_positions(machine: SchedulerMachine, seq: Sequence) -> list[int]:
    """The logical position each entry of a running sequence's view holds: the borrowed
    prefix's (a pruned one skips some), then every position computed since."""
    assert machine.world is not None
    store = machine.world.store
    node = store.borrowed_node(seq.seq_id)
    if node is None:
        return list(range(seq.num_computed_tokens))
    _, positions = store.tree.view(node)
    logical = sum(len(n.tokens) for n in store.tree.path(node))
    return positions + list(range(logical, seq.num_computed_tokens))


def _free_slots(pool: KVPool, group: int) -> list[int]:
    # The allocator's free list: the one place a slot can be counted twice or lost.
    return list(pool._alloc[group]._free)


def _cached_slots(world: World) -> set[int]:
    tree = world.store.tree
    out: set[int] = set()
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert not out & set(node.slots)
        out.update(node.slots)
        stack.extend(node.children.values())
    return out


def _borrowed(machine: SchedulerMachine) -> set[int]:
    assert machine.world is not None
    store = machine.world.store
    out: set[int] = set()
    for seq in machine.scheduler.running:
        node = store.borrowed_node(seq.seq_id)
        if node is not None:
            out.update(store.tree.view(node)[0])
    return out


def _check_borrowed(machine: SchedulerMachine) -> None:
    """A running sequence's borrowed prefix: resident, locked, first in its view."""
    assert machine.world is not None
    store = machine.world.store
    refs: dict[int, int] = {}
    for seq in machine.scheduler.running:
        node = store.borrowed_node(seq.seq_id)
        if node is None:
            continue
        borrowed = store.tree.view(node)[0]
        assert machine.pool.table(seq.seq_id)[: len(borrowed)] == borrowed
        for n in store.tree.path(node):
            assert n.tier is None and n.ref >= 1
            refs[id(n)] = refs.get(id(n), 0) + 1
    stack = list(store.tree.root.children.values())
    while stack:
        n = stack.pop()
        assert n.ref == refs.get(id(n), 0)  # locks balance: no lock leaked or lost
        stack.extend(n.children.values())


def machine_class(store: str | None, tiers: str = "none") -> type[SchedulerMachine]:
    name = f"Scheduler_{store or 'dense'}_{tiers}".replace("+", "_")
    return type(name, (SchedulerMachine,), {"store": store, "tiers": tiers})
