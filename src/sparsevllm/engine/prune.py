"""Pruning cached history: compress chosen regions of an idle chain or a cached prefix.

An agent's history often holds regions that matter less by the next turn (an old tool
output). `prune_cache` scores the resident KV of logical ranges `[start, end)` of a
cached history (`prune_select`), keeps ceil(keep_ratio x n) of each range's n resident
tokens and frees the other slots at once. The logical history is unchanged, so the next
turn still matches all of it and prefills only its new suffix; RoPE positions stay
logical (cached keys were rotated when they were computed, and new tokens take their
logical positions).

- Idle chain (chain cache, eviction methods): the chain's view shrinks through the
  runner's KVAccess, per KV head where storage has one group per layer, else one
  selection per layer group; the method's per-token state follows (`on_compressed`).
  An offloaded chain is restored first.
- Radix prefix (dense and logical methods): the tree's nodes covering the ranges drop
  slots (`RadixCache.drop_slots`). A pruned node holds fewer slots than tokens; a request
  that borrows it counts all of its tokens as cached and reads the shorter view. One
  selection serves every layer and head (dense storage shares one slot table). Nodes a
  running request reads are refused (`ChainBusyError`); offloaded nodes are restored
  first (refused the same way when the pool has no room).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from sparsevllm.engine.chain_cache import Chain, ChainBusyError, ChainCache
from sparsevllm.engine.prune_select import check_prune_method, combine, score_entries, select_keep
from sparsevllm.upload import upload


class CacheEntryNotFound(LookupError):
    """The chain or cached prefix to prune does not exist (HTTP 404)."""


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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranges"] = [list(r) for r in self.ranges]
        out["slots_freed"] = self.slots_freed
        return out


def check_prune_args(ranges: Any, method: Any, keep_ratio: Any) -> list[tuple[int, int]]:
    """Validate what does not depend on the cache; returns the ranges sorted."""
    check_prune_method(method)
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)):
        raise ValueError(f"keep_ratio must be a number in (0, 1], got {keep_ratio!r}")
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if not isinstance(ranges, (list, tuple)) or not ranges:
        raise ValueError("ranges must be a non-empty list of [start, end) token ranges")
    out = []
    for r in ranges:
        ok = isinstance(r, (list, tuple)) and len(r) == 2
        if not ok or not all(isinstance(x, int) and not isinstance(x, bool) for x in r):
            raise ValueError(f"ranges must hold [start, end] pairs of integers, got {r!r}")
        if not 0 <= r[0] < r[1]:
            raise ValueError(f"ranges must satisfy 0 <= start < end, got [{r[0]}, {r[1]}]")
        out.append((r[0], r[1]))
    out.sort()
    for (s0, e0), (s1, e1) in zip(out, out[1:]):
        if s1 < e0:
            raise ValueError(f"ranges must not overlap: [{s0}, {e0}) and [{s1}, {e1})")
    return out


@torch.inference_mode()
def prune_cache(
    engine: Any,
    chain_id: str | None,
    tokens: list[int] | None,
    ranges: Any,
    method: Any,
    keep_ratio: Any,
) -> PruneResult:
    """Prune the chain `chain_id`, or the cached history `tokens` identify (an LLMEngine's
    chain cache or radix prefix cache). Raises ValueError (bad arguments),
    CacheEntryNotFound, or ChainBusyError (in use, or no room to restore it)."""
    ranges = check_prune_args(ranges, method, keep_ratio)
    if (chain_id is None) == (tokens is None):
        raise ValueError("give exactly one of chain_id and prompt (text or token ids)")
    if engine.chains is not None:
        chain = _find_chain(engine.chains, chain_id, tokens)
        return _prune_chain(engine, chain, ranges, method, float(keep_ratio))
    if engine.prefix_cache is not None:
        if chain_id is not None:
            raise ValueError(
                f"{engine.config.sparse_method} uses the radix prefix cache, which has no "
                "chains: identify the cached prefix by its prompt or token ids"
            )
        return _prune_prefix(engine, tokens, ranges, method, float(keep_ratio))
    raise ValueError("prefix caching is off (enable_prefix_caching=False): nothing is cached")


def _find_chain(chains: ChainCache, chain_id: str | None, tokens: list[int] | None) -> Chain:
    if chain_id is not None:
        chain = chains.chains.get(chain_id)
        if chain is None:
            raise CacheEntryNotFound(f"no chain {chain_id!r} (never created, or reclaimed)")
        return chain
    assert tokens is not None
    found = [c for c in chains.chains.values() if _related(c.tokens, tokens)]
    if not found:
        raise CacheEntryNotFound("no chain's history starts with or extends these tokens")
    if len(found) > 1:
        names = ", ".join(repr(c.chain_id) for c in found[:5])
        raise ValueError(f"{len(found)} chains match these tokens ({names}): pass chain_id")
    return found[0]


def _related(a: list[int], b: list[int]) -> bool:
    """One token list is a prefix of the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _check_within(ranges: list[tuple[int, int]], length: int, what: str) -> None:
    start, end = ranges[-1]
    if end > length:
        raise ValueError(f"range [{start}, {end}) ends past the {length} cached tokens of {what}")


def _prune_chain(
    engine: Any, chain: Chain, ranges: list[tuple[int, int]], method: str, keep_ratio: float
) -> PruneResult:
    if chain.busy:
        raise ChainBusyError(f"chain {chain.chain_id!r} is busy: a running request extends it")
    _check_within(ranges, len(chain.tokens), f"chain {chain.chain_id!r}")
    if not engine.chains.bring_back(chain):
        raise ChainBusyError(
            f"chain {chain.chain_id!r} is offloaded and the KV pool has no room to restore "
            "it now; retry later"
        )
    before = chain.resident
    pool = engine.pool
    # Sliding-window groups hold only the newest window - 1 tokens: nothing to prune.
    for g, layers in enumerate(pool.layer_groups[: pool.num_main_groups]):
        _prune_group(engine, chain.owner, g, layers, ranges, method, keep_ratio)
    chain.resident = pool.resident(chain.owner)
    return PruneResult(
        "chain",
        chain.chain_id,
        len(chain.tokens),
        before,
        chain.resident,
        method,
        keep_ratio,
        ranges,
    )


def _prune_group(
    engine: Any,
    owner: int,
    group: int,
    layers: list[int],
    ranges: list[tuple[int, int]],
    method: str,
    keep_ratio: float,
) -> None:
    """One layer group of an idle chain: per KV head when the group is a single layer
    (its rows can be compacted per head), else the same tokens for all its layers."""
    kv, cfg = engine.runner.kv, engine.config
    positions = kv.logical_positions(owner, group)  # [Hkv, L]
    length = positions.shape[1]
    if length == 0:
        return
    scores = [score_entries(method, kv.keys(owner, layer), positions, cfg) for layer in layers]
    if len(layers) == 1:
        keep = select_keep(scores[0], positions, ranges, keep_ratio)  # [Hkv, B]
    else:
        keep = select_keep(combine(scores), positions[:1], ranges, keep_ratio)  # [1, B]
    if keep.shape[1] == length:
        return  # nothing to drop (keep_ratio 1, or the ranges hold no resident token)
    if len(layers) == 1:
        kv.keep_per_head(owner, layers[0], keep)
    else:
        kv.keep(owner, group, keep[0].tolist())
        keep = keep.expand(kv.num_kv_heads, -1)
    for layer in layers:
        engine.method.on_compressed(owner, layer, keep)


def _prune_prefix(
    engine: Any, tokens: list[int], ranges: list[tuple[int, int]], method: str, keep_ratio: float
) -> PruneResult:
    cache, runner, cfg = engine.prefix_cache, engine.runner, engine.config
    if runner.sliding_layers:
        # Sliding layers share the radix group's view, whose last `window` entries would
        # then span more than `window` tokens: the model would read another context.
        raise ValueError(
            "pruning a radix-cached prefix is not supported on models with sliding-window "
            "layers; use an eviction method (chain cache) to prune such histories"
        )
    _, node = cache.match(tokens)  # restores offloaded nodes on the way
    length = cache.depth(node)
    _check_restored(node, tokens, length)
    if length == 0:
        raise CacheEntryNotFound("no cached prefix of these tokens")
    _check_within(ranges, length, "the cached prefix")
    path = cache.path(node)
    _check_unlocked(path, ranges)
    slots, logical = cache.view(node)
    device = runner.k_cache[0].device
    index = upload(slots, torch.long, device)
    positions = upload(logical, torch.int32, device)
    positions = positions.expand(runner.num_kv_heads, -1)  # [Hkv, L]: shared by all heads
    scores = [
        score_entries(method, runner.k_cache[layer][index], positions, cfg)  # keys [L, Hkv, D]
        for layer in engine.pool.layer_groups[0]
    ]
    keep = select_keep(combine(scores), positions[:1], ranges, keep_ratio)[0].tolist()
    kept = {slots[i] for i in keep}
    dropped = {s for s in slots if s not in kept}
    for n in path:
        if dropped.intersection(n.slots):
            cache.drop_slots(n, dropped)
    engine.pool.free_slots(sorted(dropped))
    return PruneResult(
        "prefix",
        None,
        length,
        len(slots),
        len(slots) - len(dropped),
        method,
        keep_ratio,
        ranges,
    )


def _check_restored(node: Any, tokens: list[int], length: int) -> None:
    """The match stopped before an offloaded node: the pool had no room to restore it."""
    stopped = node.children.get(tokens[length]) if length < len(tokens) else None
    if stopped is not None and stopped.tier is not None:
        raise ChainBusyError(
            f"cached tokens from {length} on are offloaded ({stopped.tier}) and the KV pool "
            "has no room to restore them now; retry later"
        )


def _check_unlocked(path: list[Any], ranges: list[tuple[int, int]]) -> None:
    start = 0
    for node in path:
        end = start + len(node.tokens)
        if node.ref and any(s < end and start < e for s, e in ranges):
            raise ChainBusyError(
                f"cached tokens [{start}, {end}) are in use by a running request; "
                "retry when it finishes"
            )
        start = end
