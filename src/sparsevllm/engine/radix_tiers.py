"""Offload tiers for radix prefix-cache nodes: host memory, then disk.

`RadixCache.evict` hands each unlocked node without resident children to `offload`: its
K/V rows (every layer, in node order) are copied to host tensors (pinned on CUDA) or to
a file, its slots go back to the pool, and the node stays in the tree, offloaded. A
match that reaches it calls `restore`: new slots from the pool (other cached nodes are
offloaded to make room), the rows copied back in the same order, so the KV is
bit-identical. A pruned node's `positions` stay on the node and go into its file.

Order and caps. Nodes leave the pool least recently used first, leaves before parents,
so the host tier (`cpu_offload_gb`) receives them in that order; when full it gives up
its oldest entries first: to the disk tier (`disk_offload_dir`, `disk_offload_gb`) if
there is one, else the node leaves the tree with its subtree (which is offloaded too).
The disk tier drops its least recently written entries the same way. A node larger
than the host tier goes straight to disk (or leaves).

Restarts. A file records the node's whole token path, where the node starts, its
positions and rows, under the chain tier's KV fingerprint plus `"cache": "radix"`
(`disk_offload.py`: atomic writes, one directory per fingerprint). An engine started
later rebuilds the offloaded part of the tree from the directory, parents first; a file
whose parent node is not on disk too cannot be reached and is deleted. `persist` (at
`LLM.close()` and server shutdown) first writes the host tier and every unlocked
resident node to disk, so the whole idle tree survives a restart.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

from sparsevllm.engine.disk_offload import DiskStore, SavedChain, kv_fingerprint
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.offload import to_host
from sparsevllm.engine.prefix_cache import RadixCache, RadixNode
from sparsevllm.upload import upload

logger = logging.getLogger(__name__)

# A node's KV off the device: per layer (K, V), each `[rows, Hkv, D]` in node order.
NodeRows = list[tuple[torch.Tensor, torch.Tensor]]


def gather_slots(runner: Any, slots: list[int], pin: bool) -> NodeRows:
    """Host copies of every layer's K/V rows at `slots` (in that order)."""
    k_cache, v_cache = runner.k_cache, runner.v_cache
    index = upload(slots, torch.long, k_cache[0].device)
    rows = [(to_host(k[index], pin), to_host(v[index], pin)) for k, v in zip(k_cache, v_cache)]
    if k_cache[0].is_cuda:
        torch.cuda.synchronize(k_cache[0].device)  # the copies must land before reuse
    return rows


def scatter_slots(runner: Any, slots: list[int], rows: NodeRows) -> None:
    """Write `rows` back to every layer's K/V at `slots`."""
    k_cache, v_cache = runner.k_cache, runner.v_cache
    index = upload(slots, torch.long, k_cache[0].device)
    for (k, v), k_dst, v_dst in zip(rows, k_cache, v_cache):
        k_dst[index] = k.to(k_dst.device)
        v_dst[index] = v.to(v_dst.device)


def _nbytes(rows: NodeRows) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in rows)


class HostTier:
    """Host copies of offloaded nodes by node key, oldest first, within a byte cap."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.rows: dict[int, NodeRows] = {}

    def put(self, key: int, rows: NodeRows) -> None:
        self.rows[key] = rows
        self.used_bytes += _nbytes(rows)

    def take(self, key: int) -> NodeRows | None:
        rows = self.rows.pop(key, None)
        if rows is not None:
            self.used_bytes -= _nbytes(rows)
        return rows

    def oldest(self) -> int | None:
        return next(iter(self.rows), None)


class RadixTiers:
    """The `RadixCache`'s tier (`NodeTier`): offload, restore and drop nodes' KV."""

    def __init__(
        self,
        cache: RadixCache,
        pool: KVPool,
        runner: Any,
        cpu: HostTier | None,
        disk: DiskStore | None,
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.runner = runner
        self.cpu = cpu
        self.disk = disk
        self._nodes: dict[int, RadixNode] = {}  # key -> offloaded node (either tier)
        self.num_offloaded = 0
        self.num_restored = 0
        cache.tier = self
        if disk is not None:
            disk.on_evict = self._disk_evicted

    @classmethod
    def build(
        cls, config: Any, source: Any, runner: Any, pool: KVPool, cache: RadixCache
    ) -> RadixTiers | None:
        """The tiers `cpu_offload_gb` and `disk_offload_dir` ask for (None: neither),
        with the nodes an earlier engine left on disk."""
        cpu = HostTier(int(config.cpu_offload_gb * 2**30)) if config.cpu_offload_gb > 0 else None
        disk = None
        if config.disk_offload_dir is not None:
            fingerprint = kv_fingerprint(config, source, runner, pool.layer_groups)
            fingerprint["cache"] = "radix"  # never read as (or by) the chain tier
            cap = int(config.disk_offload_gb * 2**30)
            disk = DiskStore(config.disk_offload_dir, cap, fingerprint)
        if cpu is None and disk is None:
            return None
        tiers = cls(cache, pool, runner, cpu, disk)
        found = tiers.attach()
        if found:
            logger.info("radix cache: %d offloaded node(s) found on disk", found)
        return tiers

    # -- NodeTier -----------------------------------------------------------------------
    def offload(self, node: RadixNode) -> str | None:
        need = len(node.slots) * self.runner.kv_bytes_per_slot
        if self.cpu is not None and need <= self.cpu.capacity_bytes:
            self._make_cpu_room(need)
            self.cpu.put(node.key, gather_slots(self.runner, node.slots, pin=True))
            self._nodes[node.key] = node
            self.num_offloaded += 1
            return "CPU"
        if self.disk is not None:
            self._nodes[node.key] = node
            if self._write(node, gather_slots(self.runner, node.slots, pin=False)):
                self.num_offloaded += 1
                return "disk"
            self._nodes.pop(node.key, None)
        return None

    def restore(self, node: RadixNode, reserve: int = 0) -> list[int] | None:
        key = node.key
        if self.cpu is not None and key in self.cpu.rows:
            n = self.cpu.rows[key][0][0].shape[0]
            if not self.pool.can_append(n + reserve):
                return None
            rows = self.cpu.take(key)
        elif self.disk is not None and self.disk.has(key):
            n = self.disk.counts(key)[0]
            if not self.pool.can_append(n + reserve):
                return None
            data = self.disk.read(key)
            self.disk.drop(key)
            rows = list(zip(data["k"], data["v"]))
        else:
            return None
        # Out of the tier before allocating: making room offloads other nodes, which may
        # push the oldest entries out, and must not take this one.
        self._nodes.pop(key, None)
        slots = self.pool.take_slots(n)
        scatter_slots(self.runner, slots, rows)
        self.num_restored += 1
        return slots

    def drop(self, node: RadixNode) -> None:
        self._nodes.pop(node.key, None)
        if self.cpu is not None:
            self.cpu.take(node.key)
        if self.disk is not None:
            self.disk.drop(node.key)

    # -- capacity -----------------------------------------------------------------------
    def _make_cpu_room(self, need: int) -> None:
        """Free host bytes for `need`, oldest entries first: on to disk, else the node
        leaves the tree."""
        while self.cpu.used_bytes + need > self.cpu.capacity_bytes:
            key = self.cpu.oldest()
            if key is None:
                return
            node = self._nodes[key]
            rows = self.cpu.take(key)
            if self.disk is not None and self._write(node, rows):
                node.tier = "disk"
            else:
                self.cache.discard(node)

    def _disk_evicted(self, key: int) -> None:
        node = self._nodes.get(key)
        if node is not None:
            self.cache.discard(node)

    # -- disk ---------------------------------------------------------------------------
    def _write(self, node: RadixNode, rows: NodeRows) -> bool:
        path = self.cache.path(node)
        tokens = [t for n in path for t in n.tokens]
        start = len(tokens) - len(node.tokens)
        payload = {
            "tokens": torch.tensor(tokens, dtype=torch.long),  # root to the node's end
            "k": [k for k, _ in rows],
            "v": [v for _, v in rows],
        }
        extra = {"kind": "radix", "start": start, "positions": node.positions}
        name = f"radix-{uuid.uuid4().hex}"  # unique across restarts (node keys are not)
        if not self.disk.write(node.key, name, [rows[0][0].shape[0]], payload, extra):
            return False
        if self._nodes.get(node.key) is not node:
            # Making disk room evicted an ancestor written earlier: the node left with it.
            self.disk.drop(node.key)
            return False
        return True

    def attach(self) -> int:
        """Rebuild the offloaded nodes an earlier engine left on disk (parents first);
        files nothing can reach are deleted. Returns how many nodes came back."""
        if self.disk is None:
            return 0
        saved = self.disk.scan()  # oldest first
        placed: dict[str, RadixNode] = {}
        for entry in sorted(saved, key=lambda s: s.meta.get("start", -1)):
            node = self._graft(entry)
            if node is None:
                logger.warning("disk tier: %s has no parent node on disk; deleted", entry.path)
                entry.path.unlink(missing_ok=True)
            else:
                placed[entry.path.name] = node
        for entry in saved:  # the disk index keeps its least recently written order
            node = placed.get(entry.path.name)
            if node is not None:
                self.disk.register(node.key, entry)
                self._nodes[node.key] = node
        return len(placed)

    def _graft(self, entry: SavedChain) -> RadixNode | None:
        meta = entry.meta
        if meta.get("kind") != "radix":
            return None
        return self.cache.graft(entry.tokens, meta["start"], meta["positions"], "disk")

    def persist(self) -> int:
        """Write the host tier and every unlocked resident node to disk (at shutdown),
        so an engine started later rebuilds the idle tree; returns how many entries
        were written."""
        if self.disk is None:
            return 0
        before = self.disk.num_written
        cpu = self.cpu
        if cpu is not None:
            self._make_cpu_room(cpu.capacity_bytes + 1)  # all of it, oldest first
        self.cpu = None  # so that eviction writes straight to disk
        try:
            # Everything unlocked, least recently used leaves first: the disk cap then
            # drops the deepest, oldest nodes before their parents.
            self.cache.make_room(self.cache.num_cached_slots + 1)
        finally:
            self.cpu = cpu
        return self.disk.num_written - before

    # -- listings -----------------------------------------------------------------------
    def rows_of(self, node: RadixNode) -> int:
        if self.cpu is not None and node.key in self.cpu.rows:
            return self.cpu.rows[node.key][0][0].shape[0]
        return self.disk.counts(node.key)[0] if self.disk and self.disk.has(node.key) else 0

    def listing(self) -> list[dict[str, Any]]:
        """Every offloaded node: its tier, where its tokens lie in the prefix, its rows
        and their KV bytes; by position."""
        out = []
        for node, start in self.cache.offloaded():
            rows = self.rows_of(node)
            out.append(
                {
                    "tier": node.tier,
                    "start": start,
                    "logical_tokens": start + len(node.tokens),
                    "tokens": len(node.tokens),
                    "rows": rows,
                    "bytes": rows * self.runner.kv_bytes_per_slot,
                }
            )
        return sorted(out, key=lambda r: (r["start"], r["logical_tokens"]))
