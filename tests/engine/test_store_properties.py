"""Property tests of the prefix-store protocol: random request histories drive each store
(radix, chain) with each tier setup (none, host memory, host memory then disk) through
claim, match_and_lock, finish, release, make_room, prune, persist and restarts, and
check after every step that:

- every slot of every pool group is free, owned by one live sequence, or cached, and
  never two of these (the counts add up to the pool);
- what a running sequence borrowed stays resident and locked (exact lock counts);
- the KV a store holds, restores or lends is the KV of its tokens at their positions;
- the listing, the statistics and the tiers agree with the store's contents;
- method state is kept exactly for live sequences and chains not on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sparsevllm.engine.cache.store import (
    CacheEntryNotFound,
    ChainBusyError,
    PruneSpec,
    PruneTarget,
)
from store_harness import NUM_LAYERS, Engine, World, encode

TOKENS = st.integers(1, 3)  # a small vocabulary: prompts share prefixes often
INDEX = st.integers(0, 99)
MAX_LIVE = 4


class StoreMachine(RuleBasedStateMachine):
    kind = "radix"
    tiers = "none"

    def __init__(self) -> None:
        super().__init__()
        self.world = World(self.kind, self.tiers)
        self.engine = Engine(self.world)

    def teardown(self) -> None:
        self.world.close()

    def _live(self) -> list:
        return self.engine.running + self.engine.waiting

    # -- requests -----------------------------------------------------------------------
    @precondition(lambda self: len(self._live()) < MAX_LIVE)
    @rule(
        base=INDEX,
        cut=st.integers(0, 12),
        extra=st.lists(TOKENS, min_size=1, max_size=4),
        chain_id=st.sampled_from([None, None, "a", "b"]),
        outputs=st.lists(TOKENS, min_size=1, max_size=4),
    )
    def serve(
        self, base: int, cut: int, extra: list[int], chain_id: str | None, outputs: list[int]
    ) -> None:
        """A whole request at once: added, admitted, decoded, finished."""
        histories = self.engine.histories
        prompt = histories[base % len(histories)][:cut] + extra
        try:
            seq = self.engine.add(prompt, chain_id)
        except ChainBusyError:
            return
        if not self.engine.admit(seq, outputs[0]):
            return
        for token in outputs[1:]:
            if seq not in self.engine.running:
                break  # preempted by a decode that found no room: it waits again
            self.engine.decode(seq, token)
        if seq in self.engine.running:
            self.engine.finish(seq)

    @precondition(lambda self: len(self._live()) < MAX_LIVE)
    @rule(
        base=INDEX,
        cut=st.integers(0, 12),
        extra=st.lists(TOKENS, min_size=1, max_size=4),
        chain_id=st.sampled_from([None, None, "a", "b"]),
    )
    def add(self, base: int, cut: int, extra: list[int], chain_id: str | None) -> None:
        histories = self.engine.histories
        prompt = histories[base % len(histories)][:cut] + extra
        try:
            self.engine.add(prompt, chain_id)
        except ChainBusyError:
            assert self.kind == "chain" and self.world.store.chains.chains[chain_id].busy

    @precondition(lambda self: self.engine.waiting)
    @rule(i=INDEX, token=TOKENS)
    def admit(self, i: int, token: int) -> None:
        waiting = self.engine.waiting
        self.engine.admit(waiting[i % len(waiting)], token)

    @precondition(lambda self: self.engine.running)
    @rule(i=INDEX, token=TOKENS)
    def decode(self, i: int, token: int) -> None:
        running = self.engine.running
        self.engine.decode(running[i % len(running)], token)

    @precondition(lambda self: self.engine.running)
    @rule(i=INDEX)
    def finish(self, i: int) -> None:
        running = self.engine.running
        self.engine.finish(running[i % len(running)])

    @precondition(lambda self: self._live())
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        live = self._live()
        self.engine.abort(live[i % len(live)])

    @precondition(lambda self: self.kind == "chain" and self.engine.running)
    @rule(i=INDEX, group=st.integers(0, NUM_LAYERS - 1), keep_every=st.integers(2, 4))
    def evict(self, i: int, group: int, keep_every: int) -> None:
        running = self.engine.running
        self.engine.evict(running[i % len(running)], group, keep_every)

    # -- the store under pressure, pruned, saved ---------------------------------------
    @rule(n=st.integers(1, 30))
    def make_room(self, n: int) -> None:
        self.world.store.make_room(n)

    @rule(
        i=INDEX,
        by_id=st.booleans(),
        start=st.integers(0, 10),
        length=st.integers(1, 8),
        ratio=st.sampled_from([0.25, 0.5, 1.0]),
    )
    def prune(self, i: int, by_id: bool, start: int, length: int, ratio: float) -> None:
        store, histories = self.world.store, self.engine.histories
        chains = sorted(store.chains.chains) if self.kind == "chain" else []
        if by_id and chains:
            target = PruneTarget(chain_id=chains[i % len(chains)])
        else:
            target = PruneTarget(tokens=histories[i % len(histories)])
        spec = PruneSpec([(start, start + length)], "fake", ratio)
        try:
            result = store.prune(target, spec)
        except (ValueError, CacheEntryNotFound, ChainBusyError):
            return
        assert result.resident_after <= result.resident_before
        if result.chain_id is not None:  # its KV changed: this is what it holds now
            owner = store.chains.chains[result.chain_id].owner
            self.engine.snapshots[owner] = self.world.values(owner)

    @rule(restart=st.booleans())
    def persist(self, restart: bool) -> None:
        """Save to the disk tier, and maybe start a new engine on the same directory,
        which must take over what the old one saved."""
        store = self.world.store
        if restart and self.tiers == "cpu+disk":
            for seq in self._live():
                self.engine.abort(seq)
        store.persist()
        if self.tiers == "cpu+disk":  # every unlocked entry went to disk, or left
            assert store.reclaimable_slots == 0 and store.listing()["offload"]["cpu_bytes"] == 0
        if not restart or self.tiers != "cpu+disk":
            return
        before = _saved(store)
        by_chain = {}
        if self.kind == "chain":
            by_chain = {
                c.chain_id: self.engine.snapshots.get(c.owner) for c in store.chains.chains.values()
            }
        self.world.build()
        assert _saved(self.world.store) == before
        if self.kind == "chain":  # the same chains, under new owner ids
            for chain in self.world.store.chains.chains.values():
                self.engine.snapshots[chain.owner] = by_chain[chain.chain_id]

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.kind == "radix":
            check_radix(self.world, self.engine)
        else:
            check_chains(self.world, self.engine)


def _saved(store) -> list:
    """What a store holds on disk, as a restarted engine must find it."""
    if hasattr(store, "chains"):
        return sorted(
            (c["chain_id"], c["logical_tokens"], c["tier"]) for c in store.chains.listing()
        )
    rows = store.tiering.listing()
    return sorted(
        (r["tier"], r["start"], r["logical_tokens"], r["tokens"], r["rows"]) for r in rows
    )


def check_radix(world: World, engine: Engine) -> None:
    store, pool = world.store, world.pool
    tree = store.tree
    held: list[int] = []
    refs: dict[int, int] = {}  # id(node) -> readers
    for seq in engine.running:
        node = store.borrowed_node(seq.seq_id)
        borrowed = tree.view(node)[0] if node is not None else []
        assert pool.table(seq.seq_id)[: len(borrowed)] == borrowed
        for n in tree.path(node) if node is not None else []:
            assert n.tier is None  # a borrowed prefix stays resident
            refs[id(n)] = refs.get(id(n), 0) + 1
        held.extend(pool.table(seq.seq_id)[len(borrowed) :])
    cached = evictable = 0
    leaves, offloaded = [], []
    stack = [(child, 0, 0) for child in tree.root.children.values()]
    while stack:
        node, start, resident = stack.pop()
        assert node.ref == refs.get(id(node), 0)  # locks balance
        if node.tier is not None:
            assert not node.slots and all(c.tier is not None for c in node.children.values())
            assert world.stack.counts(node.key) is not None
            offloaded.append((node.tier, start, start + len(node.tokens), node.key))
        offsets = node.positions if node.positions is not None else range(len(node.slots))
        for slot, off in zip(node.slots, offsets):
            _check_kv(world, slot, encode(start + off, node.tokens[off]))
        held.extend(node.slots)
        cached += len(node.slots)
        evictable += len(node.slots) if node.ref == 0 else 0
        end, resident = start + len(node.tokens), resident + len(node.slots)
        if not node.children:
            leaves.append((end, resident))
        stack.extend((c, end, resident) for c in node.children.values())
    assert len(held) == len(set(held)) == pool.used_per_layer()[0]  # no slot twice
    assert cached == tree.num_cached_slots and evictable == store.reclaimable_slots
    listing = store.listing()
    assert listing["kv_slots_cached"] == cached == store.stats()["kv_slots_cached"]
    rows = [(p["logical_tokens"], p["resident_slots"]) for p in listing["prefixes"]]
    assert rows == sorted(leaves, reverse=True)
    if world.stack is not None:
        listed = [(r["tier"], r["start"], r["logical_tokens"]) for r in listing["offloaded"]]
        assert sorted(listed) == sorted(o[:3] for o in offloaded)
        _check_tiers(world, listing, [(o[0], o[3]) for o in offloaded])


def check_chains(world: World, engine: Engine) -> None:
    store, pool = world.store, world.pool
    live = {seq.seq_id: seq for seq in engine.running + engine.waiting}
    held: list[list[int]] = [[] for _ in range(pool.num_groups)]
    for seq_id in live:
        for g in range(pool.num_groups):
            held[g].extend(pool.table(seq_id, g) if pool.has(seq_id) else [])
    cached = 0
    idle_held = [0] * pool.num_main_groups  # slots the idle resident chains hold, per group
    tiers, kept_state = [], set()  # tiers: (tier, owner) of offloaded chains
    for chain in store.chains.chains.values():
        if chain.busy:  # the request that continues it owns its state
            assert live[chain.owner].chain_id == chain.chain_id
            continue
        assert chain.owner not in live
        if chain.tier is None:
            main = [pool.num_resident(chain.owner, g) for g in range(pool.num_main_groups)]
            assert (chain.resident, chain.reclaim) == (max(main), min(main))
            assert world.values(chain.owner) == engine.snapshots[chain.owner]
            for g in range(pool.num_groups):
                held[g].extend(pool.table(chain.owner, g))
            cached += chain.resident
            for g in range(pool.num_main_groups):
                idle_held[g] += main[g]
        else:
            assert not pool.has(chain.owner) and world.stack.counts(chain.owner) is not None
            tiers.append((chain.tier, chain.owner))
        if chain.tier != "disk":
            kept_state.add(chain.owner)
    for g, slots in enumerate(held):  # no slot twice; free + used + cached = total
        assert len(slots) == len(set(slots)) == pool.used_per_layer()[g]
    # What the fullest group's free count would gain if every idle resident chain went.
    after = [pool.num_free_in(g) + idle_held[g] for g in range(pool.num_main_groups)]
    reclaimable = min(after) - pool.num_free if any(idle_held) else 0
    assert store.reclaimable_slots == reclaimable
    running = {seq.seq_id for seq in engine.running}
    assert running | kept_state <= set(world.state.held) <= set(live) | kept_state
    listing = store.listing()
    assert listing["kv_slots_cached"] == cached == store.stats()["kv_slots_cached"]
    for row in listing["chains"]:
        chain = store.chains.chains[row["chain_id"]]
        assert row["busy"] == chain.busy and row["tier"] == chain.tier
        assert row["resident_slots"] == (0 if chain.tier else chain.resident)
    if world.stack is not None:
        _check_tiers(world, listing, tiers)


def _check_kv(world: World, slot: int, value: float) -> None:
    for layer in range(NUM_LAYERS):
        assert float(world.k[layer][slot]) == value and float(world.v[layer][slot]) == -value


def _check_tiers(world: World, listing, entries: list[tuple[str, int]]) -> None:
    """The tiers hold what the store says they hold (`entries`: tier and key of every
    offloaded entry), within their caps."""
    usage, stack = listing["offload"], world.stack
    on_cpu = [key for tier, key in entries if tier == "CPU"]
    assert usage["cpu_bytes"] == sum(stack.nbytes(stack.counts(key)) for key in on_cpu)
    assert usage["cpu_bytes"] <= usage["cpu_capacity_bytes"]
    assert usage["disk_bytes"] <= usage["disk_capacity_bytes"]
    on_disk = [key for tier, key in entries if tier == "disk"]
    files = list(stack.disk.dir.glob("*.pt")) if stack.disk is not None else []
    assert len(files) == len(on_disk)


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=35,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize("kind", ["radix", "chain"])
@pytest.mark.parametrize("tiers", ["none", "cpu", "cpu+disk"])
def test_store_protocol_invariants(kind: str, tiers: str) -> None:
    machine = type(f"{kind}_{tiers}", (StoreMachine,), {"kind": kind, "tiers": tiers})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_a_request_preempted_while_served_stops_decoding():
    """Regression (found by scripts/state_machines.py): `serve` went on decoding a
    request that a decode without room had preempted, so a waiting request took a slot
    and the slot accounting broke. The shrunk example, replayed."""
    machine = type("radix_cpu", (StoreMachine,), {"kind": "radix", "tiers": "cpu"})()
    for _ in range(15):
        machine.make_room(n=1)
    machine.serve(base=1, chain_id=None, cut=3, extra=[1], outputs=[1, 1, 1, 1])
    machine.add(base=2, chain_id=None, cut=7, extra=[1, 1])
    machine.serve(base=0, chain_id=None, cut=5, extra=[1, 1], outputs=[1, 1, 1, 1])
    machine.admit(i=0, token=1)
    machine.add(base=0, chain_id=None, cut=0, extra=[1])
    machine.serve(base=3, chain_id=None, cut=10, extra=[1, 1, 1, 1], outputs=[1, 1, 1, 1])
    preempted = [
        seq for seq in machine.engine.waiting if seq.num_preemptions or seq.output_token_ids
    ]
    assert preempted and not any(machine.world.pool.has(seq.seq_id) for seq in preempted)
    machine.consistent()
    machine.teardown()


PURE = [
    "store",
    "tiering",
    "radix_tree",
    "radix_tiering",
    "radix_store",
    "chains",
    "chain_tiering",
    "chain_store",
]


def test_the_stores_never_import_torch():
    """The stores are pure Python like the scheduler: bytes move in the tier stack."""
    imports = ", ".join(f"sparsevllm.engine.cache.{m}" for m in PURE)
    code = f"import sys, {imports}; sys.exit('torch' in sys.modules)"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
