"""The tier stack shared by both stores: host tier, then disk; caps; restores; files of
other formats (tiny KV tensors and a fake store)."""

from __future__ import annotations

from pathlib import Path

import torch

from sparsevllm.engine.cache.disk_tier import DiskTier
from sparsevllm.engine.cache.host_tier import HostTier
from sparsevllm.engine.cache.kv_rows import KVRows, StatePayload
from sparsevllm.engine.cache.tier_stack import TierStack
from sparsevllm.engine.cache.tiering import CPU, DISK, DiskRecord
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage

ROW = 2 * 2 * 4  # bytes of one slot: K and V of two layers, one float32 each


class Store:
    """A fake store (`TierClient`): entries are slot runs in the pool's one group."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.stack: TierStack
        self.moves: dict[int, str] = {}
        self.discarded: list[int] = []
        self.depends: dict[int, list[int]] = {}  # key -> keys that leave with it

    def describe(self, key: int) -> DiskRecord:
        return DiskRecord(f"entry-{key}", [key, key], {"mine": key})

    def allocate(self, key: int, counts: list[int]) -> list[list[int]]:
        return [self.pool.take_slots(counts[0])]

    def moved(self, key: int, tier: str) -> None:
        self.moves[key] = tier

    def discard(self, key: int) -> None:
        self.discarded.append(key)
        for other in self.depends.get(key, []):
            self.stack.drop(other)


class State:
    """`EntryState`: a marker per entry, which a disk file must carry."""

    def __init__(self) -> None:
        self.held: dict[int, object] = {}

    def export(self, key: int) -> StatePayload:
        return {"marker": self.held[key]}

    def load(self, key: int, state: StatePayload) -> None:
        self.held[key] = state["marker"]

    def release(self, key: int) -> None:
        del self.held[key]


class Rig:
    def __init__(self, tmp_path: Path | None, cpu_slots: int | None, disk_bytes: int = 10**6):
        self.pool = KVPool(16, 2, [[0, 1]])
        self.k = [torch.zeros(16, 1, 1) for _ in range(2)]
        self.v = [torch.zeros(16, 1, 1) for _ in range(2)]
        cpu = HostTier(cpu_slots * ROW) if cpu_slots is not None else None
        disk = DiskTier(str(tmp_path), disk_bytes, {"test": 1}) if tmp_path else None
        self.state = State()
        kv = KVRows(
            [DenseStorage.wrap(k, v) for k, v in zip(self.k, self.v)], self.pool.group_of_layer
        )
        self.stack = TierStack(self.pool, kv, cpu, disk, self.state)
        self.store = Store(self.pool)
        self.store.stack = self.stack
        self.stack.bind(self.store)

    def put(self, key: int, n: int) -> str | None:
        """An entry of `n` slots holding key*100 + i, offloaded; its slots freed."""
        slots = self.pool.take_slots(n)
        for layer in range(2):
            self.k[layer][slots] = torch.tensor([key * 100.0 + i for i in range(n)]).view(n, 1, 1)
            self.v[layer][slots] = -self.k[layer][slots]
        self.state.held[key] = f"state-{key}"
        tier = self.stack.offload(key, [slots])
        self.pool.free_slots(slots)
        return tier

    def values(self, slots: list[int]) -> list[float]:
        out = [float(x) for x in self.k[1][slots].flatten()]
        assert out == [-float(x) for x in self.v[0][slots].flatten()]
        return out

    def files(self) -> int:
        return len(list(self.stack.disk.dir.glob("*.pt")))


def test_the_host_tier_moves_its_oldest_on_to_disk_or_gives_them_up(tmp_path):
    rig = Rig(tmp_path, cpu_slots=4)
    assert rig.put(1, 3) == CPU and rig.put(2, 3) == CPU  # 1 moved on to make room
    assert rig.store.moves == {1: DISK} and rig.files() == 1
    assert rig.stack.counts(1) == [3] and rig.stack.usage()["cpu_bytes"] == 3 * ROW
    assert rig.state.held == {2: "state-2"}  # the file carries 1's state; 2's stays put
    assert rig.put(3, 5) == DISK  # larger than the host tier: straight to disk
    alone = Rig(None, cpu_slots=4)
    assert alone.put(1, 3) == CPU and alone.put(2, 3) == CPU
    assert alone.store.discarded == [1] and alone.stack.counts(1) is None
    assert alone.put(3, 5) is None  # no tier takes it
    assert alone.stack.usage()["num_offloaded"] == 2


def test_restore_is_bit_exact_honours_the_reserve_and_brings_the_state_back(tmp_path):
    rig = Rig(tmp_path, cpu_slots=4)
    rig.put(1, 3)
    rig.put(2, 3)  # 1 on disk, 2 on the host
    taken = rig.pool.take_slots(12)  # 4 slots left
    assert rig.stack.restore(1, reserve=2) is None and rig.stack.counts(1) == [3]
    [slots] = rig.stack.restore(1, reserve=1)
    assert rig.values(slots) == [100.0, 101.0, 102.0] and rig.state.held[1] == "state-1"
    assert rig.stack.counts(1) is None and rig.files() == 0
    rig.pool.free_slots(taken)
    [slots] = rig.stack.restore(2)
    assert rig.values(slots) == [200.0, 201.0, 202.0]
    usage = rig.stack.usage()
    assert usage["num_restored"] == 2 and usage["cpu_bytes"] == usage["disk_bytes"] == 0
    assert rig.stack.restore(2) is None  # not held any more


def test_the_disk_cap_gives_up_the_least_recently_written(tmp_path):
    probe = Rig(tmp_path / "probe", cpu_slots=None)
    probe.put(1, 3)
    one_file = probe.stack.usage()["disk_bytes"]
    rig = Rig(tmp_path, cpu_slots=None, disk_bytes=2 * one_file + 10)
    for key in (1, 2, 3):
        assert rig.put(key, 3) == DISK
    assert rig.store.discarded == [1] and rig.files() == 2
    assert rig.stack.counts(1) is None and rig.stack.counts(3) == [3]
    assert rig.stack.usage()["disk_bytes"] <= 2 * one_file + 10


def test_an_entry_given_up_with_the_one_it_depends_on_is_not_kept(tmp_path):
    """Moving a radix node on to disk may give up its ancestor's file to make room; the
    node leaves with it, and its own new file must go too."""
    probe = Rig(tmp_path / "probe", cpu_slots=None)
    probe.put(1, 4)
    one_file = probe.stack.usage()["disk_bytes"]  # of the larger entry
    rig = Rig(tmp_path, cpu_slots=3, disk_bytes=one_file + 10)
    assert rig.put(1, 4) == DISK  # the ancestor: too large for the host tier
    assert rig.put(2, 3) == CPU
    rig.store.depends[1] = [2]
    assert rig.put(3, 3) == CPU  # 2 moves on; its file evicts 1's, and 2 leaves with 1
    assert rig.store.discarded == [1] and 2 not in rig.store.moves
    assert rig.stack.counts(1) is None and rig.stack.counts(2) is None
    assert rig.files() == 0 and rig.stack.usage()["disk_bytes"] == 0


def test_persist_writes_the_host_tier_and_the_rest_to_disk(tmp_path):
    rig = Rig(tmp_path, cpu_slots=8)
    rig.put(1, 3)
    rig.put(2, 3)
    written = rig.stack.persist(lambda: rig.put(3, 2))  # the store's evict-all, disk only
    assert written == 3 and rig.files() == 3 and rig.store.moves == {1: DISK, 2: DISK}
    assert rig.stack.usage()["cpu_bytes"] == 0 and rig.stack.cpu is not None


def test_files_of_another_fingerprint_or_format_are_never_read(tmp_path):
    old = DiskTier(str(tmp_path), 10**6, {"format": 1, "model": "m"})
    rows = [{"k": torch.ones(2, 1, 1), "v": torch.ones(2, 1, 1)}] * 2
    assert old.write(7, DiskRecord("chain-1", [1, 2]), [2], rows, {})
    new = DiskTier(str(tmp_path), 10**6, {"format": 2, "model": "m"})
    assert new.dir != old.dir and new.scan() == []
    assert [e.name for e in old.scan()] == ["chain-1"]  # left alone
    again = DiskTier(str(tmp_path), 10**6, {"format": 1, "model": "m"})
    [entry] = again.scan()
    assert (entry.tokens, entry.counts, entry.meta) == ([1, 2], [2], {})
