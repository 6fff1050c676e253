"""Building the engine's one prefix store from its configuration.

`prefix_cache_mode` (resolved by `EngineConfig`) picks the store; `cpu_offload_gb` and
`disk_offload_dir` give it a tier stack. The store becomes the pool's reclaimer, and it
takes over what an earlier engine with the same KV fingerprint left on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache.chain_state import ChainDeviceState
from sparsevllm.engine.cache.chain_store import ChainStore
from sparsevllm.engine.cache.disk_tier import DiskTier, kv_fingerprint
from sparsevllm.engine.cache.host_tier import HostTier
from sparsevllm.engine.cache.kv_rows import KVRows
from sparsevllm.engine.cache.radix_store import RadixStore
from sparsevllm.engine.cache.store import PrefixStore
from sparsevllm.engine.cache.tier_stack import EntryState, TierStack
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.prune import RunnerPruner
from sparsevllm.engine.runner import ModelRunner
from sparsevllm.models.loader import ModelSource

logger = logging.getLogger(__name__)


def build_store(
    config: EngineConfig,
    source: ModelSource,
    runner: ModelRunner,
    pool: KVPool,
    new_owner: Callable[[], int],
) -> PrefixStore | None:
    """The store `config` asks for (None: prefix caching is off). `new_owner()` gives a
    fresh sequence id (a chain found on disk is kept under one)."""
    if not config.enable_prefix_caching:
        return None
    pruner = RunnerPruner(runner, config, pool)
    rows = KVRows(runner.kv_storage, pool.group_of_layer)  # copies of entries (`clone`)
    store: PrefixStore
    if config.prefix_cache_mode == "radix":
        tiers = build_tiers(config, source, runner, pool, "radix")
        store = RadixStore(pool, pruner, tiers, rows)
    else:
        state = ChainDeviceState(runner.kv, runner.methods, pool.num_groups)
        tiers = build_tiers(config, source, runner, pool, "chain", state)
        store = ChainStore(pool, pruner, runner.release, new_owner, tiers, rows, state)
    pool.reclaimer = store
    found = store.attach()
    if found:
        logger.info("%s cache: %d entries found in the disk tier", config.prefix_cache_mode, found)
    return store


def build_tiers(
    config: EngineConfig,
    source: ModelSource,
    runner: ModelRunner,
    pool: KVPool,
    cache: str,
    state: EntryState | None = None,
) -> TierStack | None:
    """The tiers `cpu_offload_gb` and `disk_offload_dir` ask for (None: neither). The
    disk tier's fingerprint names the store (`cache`), so chain and radix files never
    mix."""
    cpu = HostTier(int(config.cpu_offload_gb * 2**30)) if config.cpu_offload_gb > 0 else None
    disk = None
    if config.disk_offload_dir is not None:
        fingerprint = kv_fingerprint(config, source, runner, pool.layer_groups)
        fingerprint["cache"] = cache
        try:
            disk = DiskTier(
                config.disk_offload_dir, int(config.disk_offload_gb * 2**30), fingerprint
            )
        except OSError as e:  # e.g. a read-only or missing mount: serve without it
            logger.warning(
                "disk tier: cannot use %s (%s); running without a disk tier",
                config.disk_offload_dir,
                e,
            )
    if cpu is None and disk is None:
        return None
    kv = KVRows(runner.kv_storage, pool.group_of_layer)
    return TierStack(pool, kv, cpu, disk, state)
