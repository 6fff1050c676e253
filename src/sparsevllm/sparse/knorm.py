"""KNorm (Devoto et al., 2024): keep the keys with the lowest L2 norm.

Query-agnostic: low-norm keys tend to receive high attention. At the end of the
prompt each KV head keeps sink + recent + the lowest-norm keys, `decode_keep_tokens`
in all; generated tokens are appended without further eviction.
"""

from __future__ import annotations

import torch

from sparsevllm.kv.layout import MLA_LATENT
from sparsevllm.sparse.base import KVAccess, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec


class KNorm(ScoreEviction):
    name = "knorm"

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        return low_norm_first(kv.keys(step.seq_id, layer))


def low_norm_first(keys: torch.Tensor) -> torch.Tensor:
    """Keys `[L, Hkv, D]` -> `[Hkv, L]` importance: a lower L2 norm is more important."""
    norms: torch.Tensor = keys.float().norm(dim=-1)  # [L, Hkv] (torch types `norm` as Any)
    return -norms.t()


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """KNorm's rule over a cached history: it needs only the keys."""
    return low_norm_first(keys)


SPEC = MethodSpec(
    name="knorm",
    family="physical_eviction",
    description="keep the keys with the lowest L2 norm (query-agnostic), per KV head",
    method=KNorm,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
    # Its signal is the norm of each head's post-RoPE key; an MLA cache holds the shared
    # latent instead, whose c_kv part leaves kv_a_layernorm at a near-constant norm.
    refused_layouts={
        MLA_LATENT: "it ranks tokens by per-head key norms, and an MLA latent row is "
        "RMS-normalised (kv_a_layernorm), so its norm carries no such signal"
    },
)
