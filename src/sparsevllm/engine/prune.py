"""Pruning cached history: compress chosen regions of an idle chain or a cached prefix.

An agent's history often holds regions that matter less by the next turn (an old tool
output). `prune_cache` checks the request and hands it to the engine's prefix store
(`PrefixStore.prune`), which finds the history, refuses it while in use, brings it back
from an offload tier and calls this module's `RunnerPruner` for the KV: it scores the
resident entries of logical ranges `[start, end)` (`prune_select`), keeps ceil(keep_ratio
x n) of each range's n resident tokens and frees the other slots at once. The logical
history is unchanged, so the next turn still matches all of it and prefills only its
new suffix; RoPE positions stay logical (cached keys were rotated when they were
computed, and new tokens take their logical positions).

- A chain's views shrink through the runner's KVAccess, per KV head where storage has
  one group per layer, else one selection per layer group; the method's per-token state
  follows (`on_compressed`).
- A radix prefix's view is shared by every layer: one selection serves every layer and
  head, and the tree's nodes covering the ranges drop the slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.cache.store import PrefixStore, PruneResult, PruneSpec, PruneTarget
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.engine.prune_select import check_prune_method, combine, score_entries, select_keep
from sparsevllm.sparse.registry import check_slot_layout, method_spec
from sparsevllm.upload import upload

if TYPE_CHECKING:
    from sparsevllm.engine.runner import ModelRunner


def check_prune_args(ranges: object, method: object, keep_ratio: object) -> list[tuple[int, int]]:
    """Validate what does not depend on the cache (values as a request sent them);
    returns the ranges sorted."""
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
    store: PrefixStore | None,
    chain_id: str | None,
    tokens: list[int] | None,
    ranges: list[tuple[int, int]],
    method: str,
    keep_ratio: float,
) -> PruneResult:
    """Prune the chain `chain_id`, or the cached history `tokens` identify, in `store`
    (the engine's prefix store). Raises ValueError (bad arguments), CacheEntryNotFound,
    or ChainBusyError (in use, or no room to restore it)."""
    ranges = check_prune_args(ranges, method, keep_ratio)
    if (chain_id is None) == (tokens is None):
        raise ValueError("give exactly one of chain_id and prompt (text or token ids)")
    if store is None:
        raise ValueError("prefix caching is off (enable_prefix_caching=False): nothing is cached")
    spec = PruneSpec(ranges, method, float(keep_ratio))
    return store.prune(PruneTarget(chain_id, tokens), spec)


class RunnerPruner:
    """`KVPruner` over the runner's KV: scores the keys a cached history holds and
    applies the selection."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, pool: KVPool) -> None:
        self.runner = runner
        self.config = config
        self.pool = pool

    def check_shared(self) -> None:
        if self.runner.sliding_layers:
            # Sliding layers share the radix group's view, whose last `window` entries
            # would then span more than `window` tokens: the model would read another
            # context.
            raise ValueError(
                "pruning a radix-cached prefix is not supported on models with "
                "sliding-window layers; use an eviction method (chain cache) to prune such "
                "histories"
            )

    def check_method(self, method: str) -> None:
        """A scorer that cannot read this model's slot layout is refused, with its reason;
        so is pruning in an engine whose served method needs every token (`prunable`)."""
        check_slot_layout(method_spec(method), self.runner.slot_layout.name)
        held = [m for m in self.config.served_methods if not method_spec(m).prunable]
        if held:
            raise ValueError(
                f"pruning is not supported with {held[0]}: its storage needs every token "
                "of a history in position order"
            )

    def keep_shared(self, slots: list[int], positions: list[int], spec: PruneSpec) -> list[int]:
        runner, cfg, method = self.runner, self.config, spec.method
        self.check_method(method)
        device = runner.device
        index = upload(slots, torch.long, device)
        logical = upload(positions, torch.int32, device)
        logical = logical.expand(runner.num_kv_heads, -1)  # [Hkv, L]: shared by all heads
        scores = [
            # keys [L, Hkv, D], dequantized; every rank's heads
            runner.tp.all_gather(
                score_entries(method, runner.kv_storage[layer].read_keys(index), logical, cfg)
            )
            for layer in self.pool.layer_groups[0]
        ]
        keep = select_keep(combine(scores), logical[:1], spec.ranges, spec.keep_ratio)
        return keep[0].tolist()

    def prune_views(self, owner: int, spec: PruneSpec) -> None:
        pool = self.pool
        self.check_method(spec.method)
        # Sliding-window groups hold only the newest window - 1 tokens: nothing to prune.
        for g, layers in enumerate(pool.layer_groups[: pool.num_main_groups]):
            self._prune_group(owner, g, layers, spec.ranges, spec.method, spec.keep_ratio)

    def _prune_group(
        self,
        owner: int,
        group: int,
        layers: list[int],
        ranges: list[tuple[int, int]],
        method: str,
        keep_ratio: float,
    ) -> None:
        """One layer group of an idle chain: per KV head when the group is a single layer
        (its rows can be compacted per head), else the same tokens for all its layers."""
        kv, cfg, tp = self.runner.kv, self.config, self.runner.tp
        positions = kv.logical_positions(owner, group)  # [Hkv, L]
        length = positions.shape[1]
        if length == 0:
            return
        # Selection spans the heads (standardised over them, the same count dropped by
        # each), so tensor-parallel ranks decide over every rank's heads.
        scores = [
            tp.all_gather(score_entries(method, kv.keys(owner, layer), positions, cfg))
            for layer in layers
        ]
        everyone = tp.all_gather(positions)  # [Hkv of all ranks, L]
        if len(layers) == 1:
            keep = select_keep(scores[0], everyone, ranges, keep_ratio)  # [model's Hkv, B]
        else:
            keep = select_keep(combine(scores), positions[:1], ranges, keep_ratio)  # [1, B]
        if keep.shape[1] == length:
            return  # nothing to drop (keep_ratio 1, or the ranges hold no resident token)
        holder = self.runner.methods.of(owner)
        if len(layers) == 1:
            kv.keep_per_head(owner, layers[0], keep)  # cut to this rank's heads there
            if not holder.model_heads:  # the method sees this rank's heads
                keep = keep.chunk(tp.size)[tp.rank]
        else:
            kv.keep(owner, group, keep[0].tolist())
            keep = keep.expand(holder.num_kv_heads, -1)
        for layer in layers:
            holder.on_compressed(owner, layer, keep)
