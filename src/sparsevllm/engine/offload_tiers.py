"""Where an idle chain's KV goes when the pool needs room: the CPU tier, then disk.

`ChainCache` calls `offload(chain)` (the tier's name, or None: the chain is dropped)
and `restore(chain)`. The CPU tier keeps the method's state in place (same process).
A disk entry is complete on its own: the K/V rows, the logical position of every view
entry and the method's per-sequence state (`SparseMethod.export_state`) are saved, and
freed in memory. So a later engine with the same KV fingerprint registers the saved
chains on start (`attach`) and continues them exactly as this one would; `persist`
writes every idle chain to disk (at shutdown).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sparsevllm.engine.chain_cache import Chain, ChainCache
from sparsevllm.engine.disk_offload import DiskStore, kv_fingerprint
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.offload import CpuOffloadStore, Rows, gather_rows, scatter_rows


class OffloadTiers:
    def __init__(
        self, pool: KVPool, runner: Any, cpu: CpuOffloadStore | None, disk: DiskStore | None
    ) -> None:
        self.pool = pool
        self.runner = runner
        self.cpu = cpu
        self.disk = disk
        self.chains: ChainCache | None = None
        self.num_offloaded = 0  # chains moved to a tier (to CPU, or straight to disk)
        self.num_restored = 0

    @classmethod
    def build(cls, config: Any, source: Any, runner: Any, pool: KVPool) -> OffloadTiers | None:
        """The tiers `cpu_offload_gb` and `disk_offload_dir` ask for (None: neither)."""
        cpu = disk = None
        if config.cpu_offload_gb > 0:
            cap = int(config.cpu_offload_gb * 2**30)
            cpu = CpuOffloadStore(pool, runner.k_cache, runner.v_cache, cap)
        if config.disk_offload_dir is not None:
            fingerprint = kv_fingerprint(config, source, runner, pool.layer_groups)
            cap = int(config.disk_offload_gb * 2**30)
            disk = DiskStore(config.disk_offload_dir, cap, fingerprint)
        return cls(pool, runner, cpu, disk) if cpu or disk else None

    def attach(self, chains: ChainCache, new_owner: Callable[[], int]) -> int:
        """Register the chains an earlier engine left on disk (oldest first); returns
        how many. Chains the disk tier evicts later are dropped from `chains`."""
        self.chains = chains
        if self.disk is None:
            return 0
        self.disk.on_evict = chains.drop_owner
        saved = self.disk.scan()
        for entry in saved:
            owner = new_owner()
            self.disk.register(owner, entry)
            chains.adopt(entry.chain_id, owner, entry.tokens, max(entry.counts), "disk")
        return len(saved)

    # -- ChainCache callbacks -----------------------------------------------------------
    def offload(self, chain: Chain) -> str | None:
        tier = self._offload(chain)
        self.num_offloaded += tier is not None
        return tier

    def _offload(self, chain: Chain) -> str | None:
        if self.cpu is not None:
            self._demote_for(self.cpu.need_bytes(chain.owner))
            if self.cpu.offload(chain.owner):
                return "CPU"
        if self.disk is not None and self.pool.has(chain.owner) and self._write(chain, None):
            return "disk"
        return None

    def restore(self, chain: Chain) -> bool:
        done = False
        if self.cpu is not None and self.cpu.has(chain.owner):
            done = self.cpu.restore(chain.owner)
        elif self.disk is not None and self.disk.has(chain.owner):
            done = self._read(chain)
        self.num_restored += done
        return done

    def drop(self, owner: int) -> None:
        if self.cpu is not None:
            self.cpu.drop(owner)
        if self.disk is not None:
            self.disk.drop(owner)

    def persist(self, chains: ChainCache) -> int:
        """Write every idle chain not on disk yet to disk, least recently used first (so
        the newest survive the cap); returns how many were written."""
        if self.disk is None:
            return 0
        idle = [c for c in chains.chains.values() if not c.busy and c.tier != "disk"]
        written = 0
        for chain in sorted(idle, key=lambda c: c.last_used):
            rows = self.cpu.take(chain.owner) if chain.tier == "CPU" else None
            if rows is None and not self.pool.has(chain.owner):
                continue
            if self._write(chain, rows):
                chain.tier = "disk"
                written += 1
            else:
                chains.drop(chain)
        return written

    def _demote_for(self, need: int) -> None:
        """Make CPU room for `need` bytes by moving the oldest CPU chains to disk, so the
        CPU tier holds the most recently offloaded chains."""
        if self.disk is None or self.chains is None or need > self.cpu.capacity_bytes:
            return
        while self.cpu.used_bytes + need > self.cpu.capacity_bytes:
            owner = self.cpu.oldest()
            chain = self.chains.by_owner(owner) if owner is not None else None
            if chain is None:
                return
            if self._write(chain, self.cpu.take(owner)):
                chain.tier = "disk"
            else:
                self.chains.drop(chain)

    # -- disk entries -------------------------------------------------------------------
    def _write(self, chain: Chain, rows: Rows | None) -> bool:
        r, owner = self.runner, chain.owner
        if rows is None:
            rows = gather_rows(self.pool, r.k_cache, r.v_cache, owner, pin=False)
        counts, layers_kv = rows
        records = r.kv.positions.export(owner, self.pool.num_groups)
        payload = {
            "tokens": torch.tensor(chain.tokens, dtype=torch.long),
            "k": [k for k, _ in layers_kv],  # per layer [n, Hkv, D], view order
            "v": [v for _, v in layers_kv],
            "positions": [None if rec is None else rec[0] for rec in records],
            "next_pos": [-1 if rec is None else rec[1] for rec in records],
            "method_state": r.method.export_state(owner),
        }
        if not self.disk.write(owner, chain.chain_id, counts, payload):
            return False
        self.pool.release(owner)
        r.method.release(owner)
        r.kv.forget(owner)
        return True

    def _read(self, chain: Chain) -> bool:
        r, owner = self.runner, chain.owner
        counts = self.disk.counts(owner)
        if not self.pool.can_append(max(counts[: self.pool.num_main_groups])):
            return False
        data = self.disk.read(owner)
        # Out of the index before allocating: making room may write other chains to
        # disk, and must not evict this one.
        self.disk.drop(owner)
        scatter_rows(
            self.pool, r.k_cache, r.v_cache, owner, (counts, list(zip(data["k"], data["v"])))
        )
        records = [
            None if kept is None else (kept, next_pos)
            for kept, next_pos in zip(data["positions"], data["next_pos"])
        ]
        r.kv.positions.load(owner, records)
        r.method.import_state(owner, data["method_state"], r.device)
        return True


def offload_stats(tiers: Any) -> dict[str, int]:
    """Engine stats of the offload tiers (`OffloadTiers` or `RadixTiers`, or None):
    entries (idle chains or radix nodes) moved out and back, and the bytes held."""
    cpu = tiers.cpu if tiers is not None else None
    disk = tiers.disk if tiers is not None else None
    return {
        "num_kv_offloaded": tiers.num_offloaded if tiers is not None else 0,
        "num_kv_restored": tiers.num_restored if tiers is not None else 0,
        "kv_offload_cpu_bytes": cpu.used_bytes if cpu is not None else 0,
        "kv_offload_disk_bytes": disk.used_bytes if disk is not None else 0,
    }
