"""Strided history sampling: sink + recent + every s-th older token (a cheap baseline).

Query- and key-agnostic: the kept set depends on positions only, so it is the same for
every KV head (stored as one selection). At the end of the prompt, a layer holding L > B
tokens (B = `decode_keep_tokens`) keeps B of them:

- the first `sink_keep_tokens` (S) and the last `recent_keep_tokens` (R), clamped to B
  exactly as `select_keep` clamps them;
- from the middle [S, L - R) (M tokens, room m = B - S - R), the grid positions S,
  S + s, S + 2s, ... with s = `strided_stride`; with 0 (the default) s = ceil(M / m),
  the smallest stride whose grid fits the room, so the samples span the whole middle
  evenly;
- if the grid holds more than m tokens (a fixed stride too fine for the budget), its
  newest m; if fewer, the rest of the room goes to the newest off-grid tokens.

Generated tokens are appended without further eviction.

Pruning a cached history (`LLM.prune`, which has a keep ratio per range but no budget):
entries whose logical position p is on the grid p % s == 0 are kept first, newest first;
with stride 0 the grid is dyadic: entries are ranked by the largest k with p % 2^k == 0
(newest first within k), so any keep ratio keeps an evenly spaced grid of stride 2^k
plus the newest entries of the next finer one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class StridedKnobs(MethodKnobs):
    strided_stride: int = knob(
        0,
        "Strided: keep every s-th older token after the sink (0: the stride whose grid "
        "fills the budget over the whole history).",
        minimum=0,
    )


class Strided(ScoreEviction):
    name = "strided"
    knobs: StridedKnobs

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        length = kv.resident(step.seq_id, layer)
        scores = strided_scores(
            length,
            self.config.sink_keep_tokens,
            self.config.recent_keep_tokens,
            self.layer_budget(layer),
            self.knobs.strided_stride,
            kv.device,
        )
        return scores.expand(self.num_kv_heads, length)  # [Hkv, L]: the same for every head


def grid_stride(length: int, sink: int, recent: int, budget: int, stride: int) -> int:
    """The stride in use: `stride`, or for 0 the smallest one whose grid over the middle
    fits the budget's room (sink and recent clamped as `select_keep` clamps them)."""
    if stride > 0:
        return stride
    sink = min(sink, budget)
    recent = min(recent, budget - sink)
    middle, room = length - sink - recent, budget - sink - recent
    if room <= 0 or middle <= room:
        return 1
    return -(-middle // room)  # ceil: ceil(middle / s) <= room grid tokens


def strided_scores(
    length: int, sink: int, recent: int, budget: int, stride: int, device: torch.device
) -> torch.Tensor:
    """`[L]` importance: grid positions above every other token, newer above older.

    Exact integers in float32 below 2^24, i.e. for views under 8M tokens."""
    s = grid_stride(length, sink, recent, budget, stride)
    sink = min(sink, budget)
    pos = torch.arange(length, device=device)  # [L]
    on_grid = (pos >= sink) & ((pos - sink) % s == 0)
    return (on_grid.long() * length + pos).float()


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """The strided rule over a cached history's logical positions `[Hkv, L]` (the keys
    are not read): the grid p % s == 0 first, or with stride 0 the dyadic levels; newest
    first within a level. Returns `[Hkv, L]` ranks (higher is kept)."""
    assert isinstance(knobs, StridedKnobs)
    pos = positions.long()  # [Hkv, L]
    if knobs.strided_stride > 0:
        level = (pos % knobs.strided_stride == 0).long()
    else:
        lowest_bit = pos & -pos  # 2^k for the largest k with p % 2^k == 0 (0 for p = 0)
        level = torch.log2(lowest_bit.double().clamp_min(1)).long()
        level = level.masked_fill(pos == 0, 63)  # 0 is on every grid
    span = int(pos.max()) + 1 if pos.numel() else 1
    order = level * span + pos  # [Hkv, L]: level first, then position
    return order.argsort(dim=-1).argsort(dim=-1).float()  # ranks: exact in float32


SPEC = MethodSpec(
    name="strided",
    family="physical_eviction",
    description="at prefill end keep sink + recent + every s-th older token (a position-only "
    "baseline; the stride fills the budget by default)",
    method=Strided,
    knobs=StridedKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
