"""KeyDiff (Park et al., 2025): evict the keys most similar to the head's mean key.

"KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv 2504.15364). Query-agnostic: keys that point
away from the average key direction tend to receive the most attention, so the keys most
similar to the average are the ones to evict.

Rule, per layer and KV head h, over the L resident tokens at the end of the prompt:

    a_h = mean_j  k_j / ||k_j||          (the anchor: mean of the unit keys)
    s_j = -cos(k_j, a_h)                 (higher is kept: least similar to the anchor)

and each KV head keeps sink + recent + the highest s_j, `decode_keep_tokens` in all
(`ScoreEviction` selection). Generated tokens are appended without further eviction.
The anchor is taken over every resident key, sink and recent included.

Difference from the paper: KeyDiff evicts block by block while it prefills in blocks
(the anchor over the cache plus the new block), to bound memory during prefill. Here the
selection runs once, over the whole prompt (the paper's rule with a single block), so it
does not depend on `chunk_prefill_size`. The method has no knobs of its own.
"""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import KVAccess, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec

_EPS = 1e-12  # zero keys (and a zero anchor) have cosine 0 instead of NaN


class KeyDiff(ScoreEviction):
    name = "keydiff"

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        return keydiff_scores(kv.keys(step.seq_id, layer))


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """Keys `[L, Hkv, D]` -> `[Hkv, L]`: minus the cosine of each key with its head's
    mean unit key."""
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(_EPS)  # [Hkv, L, D]
    anchor = unit.mean(dim=1, keepdim=True)  # [Hkv, 1, D]
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    cos: torch.Tensor = (unit * anchor).sum(dim=-1)  # [Hkv, L]
    return -cos


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """KeyDiff's rule over a cached history: it needs only the keys (the anchor is the
    mean over the history's resident entries of each head)."""
    return keydiff_scores(keys)


SPEC = MethodSpec(
    name="keydiff",
    family="physical_eviction",
    description="at prefill end keep sink + recent + the keys least similar (cosine) to the "
    "head's mean key, per KV head",
    method=KeyDiff,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
