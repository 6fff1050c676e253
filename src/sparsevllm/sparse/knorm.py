"""KNorm (Devoto et al., 2024): keep the keys with the lowest L2 norm.

Query-agnostic: low-norm keys tend to receive high attention. At the end of the
prompt each KV head keeps sink + recent + the lowest-norm keys, `decode_keep_tokens`
in all; generated tokens are appended without further eviction.
"""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec


class KNorm(ScoreEviction):
    name = "knorm"

    def score(self, layer, step, kv, attn):
        keys = kv.keys(step.seq_id, layer)  # [L, Hkv, D]
        return -keys.float().norm(dim=-1).t()  # [Hkv, L]: a lower norm is more important


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """KNorm's rule over a cached history: a lower key norm is more important; needs
    only keys. keys `[L, Hkv, D]` -> `[Hkv, L]`."""
    return -keys.float().norm(dim=-1).t()


SPEC = MethodSpec(
    name="knorm",
    family="physical_eviction",
    description="keep the keys with the lowest L2 norm (query-agnostic), per KV head",
    method=KNorm,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
