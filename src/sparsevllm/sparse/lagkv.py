"""LagKV (Liang et al., 2025): score each chunk's tokens against the next ("lag") chunk.

"LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important"
(arXiv 2504.04704). Attention-free: the keys and values themselves say which tokens
matter. A token whose K/V deviate most from the value range of the chunk that follows it
carries information the following context does not repeat, so it is kept.

Rule, per layer and KV head, over the L resident tokens at the end of the prompt, with
S = `sink_keep_tokens` and W = `lagkv_lag_size`:

1. After the first S tokens the view is cut into n = floor((L - S) / W) partitions
   P_i = [S + iW, S + (i + 1)W).
2. A partition P_i with a successor (i < n - 1) is scored against P_{i+1}, for X in
   {K, V}: per channel c, lo_c and hi_c are the min and max of X[t, c] over t in
   P_{i+1}; a token t of P_i deviates by
       d_X(t) = std_c((X[t, c] - lo_c) / (hi_c - lo_c))   (unbiased std over the D
   channels; a range under 1e-6 counts as 1e-6), and scores
       s(t) = softmax_{P_i}(d_K)(t) + softmax_{P_i}(d_V)(t)   (softmax over P_i's tokens).
3. The last full partition and the remainder (the "lag tail": no complete successor
   yet) are kept before any scored token, newest first; the sink is kept by
   `ScoreEviction`'s selection, and the last `recent_keep_tokens` too.
4. The paper keeps a fixed fraction of every scored partition (its top tokens by s).
   The budget here is a token count (`decode_keep_tokens`), so it is spread evenly:
   the room left after sink, recent and tail goes rank level by rank level (every
   partition's best token by s, then every partition's second, ...; within a level the
   higher s first, the newer token on a tie).

Differences from the paper: (4), and the paper compresses recursively as the sequence
grows by W tokens (decode included), while here the selection runs once, at the end of
the prompt (generated tokens are appended without further eviction, as in SnapKV), so
it does not depend on `chunk_prefill_size`. A prompt shorter than S + 2W has no scored
partition: it keeps its newest tokens (StreamingLLM's choice).

Pruning a cached history (`LLM.prune`) scores its keys only (a pruning scorer receives
no values): step 2 with s = softmax(d_K), partitions from the view's first entry (S = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob

_MIN_RANGE = 1e-6  # a reference channel with (almost) no range: deviations stay finite


@dataclass(frozen=True)
class LagKVKnobs(MethodKnobs):
    lagkv_lag_size: int = knob(
        128,
        "LagKV: partition size W; each partition is scored against the next one's "
        "per-channel min/max.",
        minimum=2,
    )


class LagKV(ScoreEviction):
    name = "lagkv"
    knobs: LagKVKnobs

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        keys = kv.keys(step.seq_id, layer)  # [L, Hkv, D]
        values = kv.values(step.seq_id, layer)  # [L, Hkv, D]
        return lagkv_scores(keys, values, self.config.sink_keep_tokens, self.knobs.lagkv_lag_size)


def lag_softmax(x: torch.Tensor, num_scored: int, lag: int) -> torch.Tensor:
    """`x` `[(n_scored + 1) * W, Hkv, D]` (the scored partitions and the first tail one)
    -> `[n_scored, W, Hkv]`: softmax over each partition of its tokens' deviation from
    the next partition's per-channel range."""
    parts = x.float().unflatten(0, (num_scored + 1, lag))  # [n + 1, W, Hkv, D]
    ref = parts[1:]
    lo = ref.amin(dim=1, keepdim=True)  # [n, 1, Hkv, D]
    hi = ref.amax(dim=1, keepdim=True)
    norm = (parts[:-1] - lo) / (hi - lo).clamp_min(_MIN_RANGE)  # [n, W, Hkv, D]
    dev: torch.Tensor = norm.std(dim=-1)  # [n, W, Hkv] (torch types `std` as Any)
    return dev.softmax(dim=1)


def lagkv_scores(
    keys: torch.Tensor, values: torch.Tensor | None, sink: int, lag: int
) -> torch.Tensor:
    """Keys (and values) `[L, Hkv, D]` -> `[Hkv, L]` ranks (higher is kept, exact
    integers in float32): the tail and sink above every scored token, scored tokens by
    (rank in their partition, s). `values=None` scores keys only."""
    length, heads, _ = keys.shape
    num_scored = max(max(length - sink, 0) // lag - 1, 0)
    # Tail and sink: lag + position / L, above every scored token's key (< lag).
    pos = torch.arange(length, device=keys.device, dtype=torch.float64)
    order = (lag + pos / length).expand(heads, length).clone()  # [Hkv, L]
    if num_scored > 0:
        span = slice(sink, sink + (num_scored + 1) * lag)
        s = lag_softmax(keys[span], num_scored, lag)  # [n, W, Hkv]
        if values is not None:
            s = s + lag_softmax(values[span], num_scored, lag)
        # [n, W, Hkv]: 0 is a partition's lowest s (the older token on a tie)
        rank = s.sort(dim=1, stable=True).indices.argsort(dim=1)
        # s / 4 <= 1/2 orders a rank level without crossing into the next one.
        scored = (rank.double() + s.double() / 4).flatten(0, 1).t()  # [Hkv, n * W]
        order[:, sink : sink + num_scored * lag] = scored
    # Stable: equal keys rank the older token lower, so the newer one is kept.
    return order.sort(dim=-1, stable=True).indices.argsort(dim=-1).float()


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """LagKV over a cached history's keys (no values reach a pruning scorer), with
    partitions from the view's first entry. keys `[L, Hkv, D]` -> `[Hkv, L]`."""
    assert isinstance(knobs, LagKVKnobs)
    return lagkv_scores(keys, None, 0, knobs.lagkv_lag_size)


SPEC = MethodSpec(
    name="lagkv",
    family="physical_eviction",
    description="at prefill end keep sink + recent + the tokens whose K/V deviate most from "
    "the next partition's min-max range, per KV head (attention-free)",
    method=LagKV,
    knobs=LagKVKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
