"""Layer groups when several methods share one pool: the pool keeps the methods' common
layout (theirs when they agree, else one group per managed layer), and a method whose
groups are coarser sees its own groups through `GroupedKV` (a `keep` of its group
applies to each pool group of its layers)."""

from __future__ import annotations

import torch

from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.sparse.base import HeadRanks, KVAccess, SparseMethod


def common_layout(methods: list[SparseMethod]) -> list[list[int]]:
    """The pool's layer groups for `methods`: theirs when they agree, else one group per
    managed layer (every method's groups are unions of those)."""
    layouts = {tuple(tuple(g) for g in m.layer_groups()) for m in methods}
    if len(layouts) == 1:
        return [list(g) for g in next(iter(layouts))]
    layout = [[layer] for layer in methods[0].layers]
    for method in methods:
        check_layout(method, layout)
    return layout


def check_layout(method: SparseMethod, layout: list[list[int]]) -> None:
    """Raise if `method` cannot run on the pool's layer groups."""
    own = [list(g) for g in method.layer_groups()]
    if own == layout:
        return
    if not method.finer_groups_ok or len(layout) < len(own):
        raise ValueError(
            f"{method.name} keeps {len(own)} slot table(s) for its {len(method.layers)} "
            f"layers and cannot share an engine whose pool keeps {len(layout)} (a method "
            "that evicts per layer is served beside it); serve it from an engine of its "
            "own, or beside methods of its layout"
        )


def method_kv(method: SparseMethod, kv: RunnerKV) -> KVAccess:
    """`kv` as `method` sees it: its own layer groups over the pool's."""
    own = method.layer_groups()
    if len(own) == kv.pool.num_main_groups:
        return kv
    return GroupedKV(kv, own)


class GroupedKV:
    """`KVAccess` for a method whose layer groups are unions of the pool's: its group g
    is every pool group of its layers (a `keep` applies to each of them)."""

    def __init__(self, kv: RunnerKV, groups: list[list[int]]) -> None:
        self.kv = kv
        self._group_of = {layer: g for g, layers in enumerate(groups) for layer in layers}
        pool_groups = kv.pool.group_of_layer
        self._pool_groups = [sorted({pool_groups[la] for la in layers}) for layers in groups]

    @property
    def num_layers(self) -> int:
        return self.kv.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.kv.num_kv_heads

    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def resident(self, seq_id: int, layer: int) -> int:
        return self.kv.resident(seq_id, layer)

    def view_slots(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> list[int]:
        return self.kv.view_slots(seq_id, layer, start, end)

    def view_tensor(self, seq_id: int, layer: int) -> torch.Tensor:
        return self.kv.view_tensor(seq_id, layer)

    def gather_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv.gather_keys(layer, slots)

    def group_of(self, layer: int) -> int:
        return self._group_of[layer]

    def rope_frequencies(self, layer: int) -> torch.Tensor | None:
        return self.kv.rope_frequencies(layer)

    def head_ranks(self) -> HeadRanks:
        return self.kv.head_ranks()

    def keys(self, seq_id: int, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self.kv.keys(seq_id, layer, start, end)

    def values(
        self, seq_id: int, layer: int, start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        return self.kv.values(seq_id, layer, start, end)

    def keep(self, seq_id: int, group: int, positions: list[int]) -> None:
        for pool_group in self._pool_groups[group]:
            self.kv.keep(seq_id, pool_group, positions)

    def keep_per_head(self, seq_id: int, layer: int, positions: torch.Tensor) -> None:
        self.kv.keep_per_head(seq_id, layer, positions)
