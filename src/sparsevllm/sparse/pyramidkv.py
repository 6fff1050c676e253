"""PyramidKV (Cai et al., 2024): SnapKV scoring with a budget pyramid over layers.

Lower layers attend broadly and keep more tokens, upper layers keep fewer. Layer
budgets fall linearly from the bottom layer to the top one, whose share is the mean
budget (`decode_keep_tokens`) divided by `pyramidkv_beta`; the total equals
about `decode_keep_tokens` x layers (more where the floor applies: no layer keeps
fewer than sink + recent + 1 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsevllm.sparse.base import MethodSettings
from sparsevllm.sparse.snapkv import SnapKV, SnapKVKnobs
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodSpec, knob


@dataclass(frozen=True)
class PyramidKVKnobs(SnapKVKnobs):
    pyramidkv_beta: float = knob(
        20.0,
        "PyramidKV: the top layer keeps decode_keep_tokens / beta of the mean budget's "
        "share; budgets fall linearly from the bottom layer.",
        minimum=1,
    )


class PyramidKV(SnapKV):
    name = "pyramidkv"
    knobs: PyramidKVKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        c = self.config
        # The pyramid runs over the managed layers (sliding-window layers keep their window).
        budgets = pyramid_budgets(
            c.decode_keep_tokens,
            len(self.layers),
            self.knobs.pyramidkv_beta,
            c.sink_keep_tokens + c.recent_keep_tokens + 1,
        )
        self.budgets = dict(zip(self.layers, budgets))

    def layer_budget(self, layer: int) -> int:
        return self.budgets[layer]


def pyramid_budgets(mean: int, num_layers: int, beta: float, floor: int) -> list[int]:
    """Linearly decreasing budgets (layer 0 largest) that sum to about mean x layers."""
    if num_layers == 1:
        return [max(mean, floor)]
    top = mean / beta
    bottom = 2 * mean - top
    step = (bottom - top) / (num_layers - 1)
    return [max(floor, round(bottom - step * layer)) for layer in range(num_layers)]


SPEC = MethodSpec(
    name="pyramidkv",
    family="physical_eviction",
    description="SnapKV scoring with budgets shrinking from lower to upper layers",
    method=PyramidKV,
    knobs=PyramidKVKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    prefill_policy="long_bs1full_short_batch",
    chain_cache=True,
)
