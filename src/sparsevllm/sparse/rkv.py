"""R-KV (Cai et al., 2025): redundancy-aware KV compression during long generation.

"R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (arXiv 2505.24133).
Reasoning traces repeat themselves; a token whose key is much like many others adds
little, even when it is attended. R-KV decodes into a buffer and, every `rkv_interval`
generated tokens, compresses the layer back to its budget by importance minus
redundancy.

Rule, per layer and KV head over the L resident tokens, when a sequence holds more than
B + I tokens after a step (B = `decode_keep_tokens`, I = `rkv_interval`; prompt chunks
included, so a long prompt is compressed as it is prefilled), and at the end of the
prompt when it holds more than B:

    I_j = a_j / sum_i a_i, a_j = attention the last W = `rkv_window_size` queries pay to
          token j (summed over the window, averaged over the KV head's query heads)
    R_j = softmax_j( mean_{i != j} cos(k_i, k_j) )       (redundancy, over resident keys)
    s_j = lambda I_j - (1 - lambda) R_j,   lambda = `rkv_lambda`

and the head keeps sink + recent + the highest s_j, B in all (`ScoreEviction`). So no
layer holds more than B + I tokens after a decode step. Every step reports the attention
of its last min(n, W) queries (decode: its one); the window is the steps that end within
the last W positions (a prompt chunk counts whole, so at a chunk boundary the window can
hold up to 2W - 1 queries).

Differences from the paper: its redundancy step also exempts, for each token, the most
recent of its near-duplicates (similarity above a threshold) before averaging; here every
other resident key counts (no threshold knob). The window's queries are the last W that
ran, as reported per step (see above). The paper's setting is long generations after
short prompts; here a prompt longer than the budget is compressed by the same rule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep
from sparsevllm.sparse.interval import IntervalEviction
from sparsevllm.sparse.score_eviction import gqa_mean
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob

_EPS = 1e-12  # zero keys have cosine 0 instead of NaN


@dataclass(frozen=True)
class RKVKnobs(MethodKnobs):
    rkv_interval: int = knob(
        128, "R-KV: compress back to the budget once this many tokens above it.", minimum=1
    )
    rkv_window_size: int = knob(
        8, "R-KV: the last queries whose attention measures importance.", minimum=1
    )
    rkv_lambda: float = knob(
        0.1,
        "R-KV: weight of importance against redundancy (score = l I - (1 - l) R).",
        minimum=0,
        maximum=1,
    )


@dataclass
class Vote:
    """One step's attention of its reported queries, the last ending at position `end`."""

    end: int
    votes: torch.Tensor  # [Hkv, L_step] summed over the rows, GQA-averaged


class RKV(IntervalEviction):
    name = "rkv"
    knobs: RKVKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self.budget = self.config.decode_keep_tokens
        self.interval = self.knobs.rkv_interval
        self.window = self.knobs.rkv_window_size
        self._votes: dict[int, dict[int, deque[Vote]]] = {}  # seq -> layer -> last steps

    def decode_score_rows(self) -> int:
        return 1

    def prefill_score_rows(self, step: SeqStep) -> int:
        return min(step.num_new, self.window)  # the chunk's last queries

    def may_compress(self, step: SeqStep) -> bool:
        return True  # at the prompt's end, and whenever a layer passes budget + interval

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            layers = self._votes.setdefault(step.seq_id, {})
            for layer, rows in scores.items():
                attn = rows[step.row]  # [num_heads, L] of the step's last queries
                if attn is not None:
                    votes = gqa_mean(attn.float(), self.num_kv_heads)  # [Hkv, L]
                    layers.setdefault(layer, deque(maxlen=self.window))
                    layers[layer].append(Vote(step.end, votes))
        super().after_step(steps, scores, kv)

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        keys = kv.keys(step.seq_id, layer)  # [L, Hkv, D]
        recent = self._votes.get(step.seq_id, {}).get(layer, deque())
        importance = window_votes(recent, step.end - self.window, keys.shape[0], keys.device)
        return rkv_scores(importance, keys, self.knobs.rkv_lambda)

    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        recent = self._votes.get(seq_id, {}).get(layer)
        if not recent:
            return
        keep = keep.to(recent[0].votes.device)
        width = int(keep.max()) + 1
        for vote in recent:  # follow the compaction (tokens a vote did not see: 0)
            padded = torch.nn.functional.pad(vote.votes, (0, max(0, width - vote.votes.shape[1])))
            vote.votes = padded.gather(1, keep)

    def release(self, seq_id: int) -> None:
        self._votes.pop(seq_id, None)

    def export_state(self, seq_id: int) -> dict[str, torch.Tensor]:
        """The window's votes per layer, oldest first (a continued chain scores with them
        at its next eviction)."""
        out: dict[str, torch.Tensor] = {}
        for layer, recent in self._votes.get(seq_id, {}).items():
            for i, vote in enumerate(recent):
                out[f"{layer}.{i}.votes"] = vote.votes.cpu()  # [Hkv, L_step]
                out[f"{layer}.{i}.end"] = torch.tensor(vote.end)
        return out

    def import_state(
        self, seq_id: int, state: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        keys = sorted({tuple(int(x) for x in key.split(".")[:2]) for key in state})
        layers: dict[int, deque[Vote]] = {}
        for layer, i in keys:
            vote = Vote(int(state[f"{layer}.{i}.end"]), state[f"{layer}.{i}.votes"].to(device))
            layers.setdefault(layer, deque(maxlen=self.window)).append(vote)
        self._votes[seq_id] = layers


def window_votes(
    recent: deque[Vote], after: int, length: int, device: torch.device
) -> torch.Tensor:
    """Summed votes `[Hkv, length]` of the steps ending after position `after` (the
    window); tokens a step did not see get nothing from it."""
    total: torch.Tensor | None = None
    for vote in recent:
        if vote.end <= after:
            continue
        v = torch.nn.functional.pad(vote.votes, (0, length - vote.votes.shape[1]))
        total = v if total is None else total + v
    if total is None:
        return torch.zeros(0, length, device=device)
    return total


def rkv_scores(importance: torch.Tensor, keys: torch.Tensor, lam: float) -> torch.Tensor:
    """Importance `[Hkv, L]` (or `[0, L]`: none) and keys `[L, Hkv, D]` -> `[Hkv, L]`
    scores lambda I - (1 - lambda) R (higher kept)."""
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    length = k.shape[1]
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    # sum_i cos(k_i, k_j) = u_j . sum_i u_i: the row sums of the [Hkv, L, L] similarity
    # matrix without building it (32 GB at 32K tokens and 8 KV heads).
    row_sums = (unit @ unit.sum(dim=1).unsqueeze(-1)).squeeze(-1)  # [Hkv, L]
    self_sim = (unit * unit).sum(dim=-1)  # [Hkv, L]: 1, or 0 for a zero key
    others = (row_sums - self_sim) / max(length - 1, 1)  # [Hkv, L]
    redundancy: torch.Tensor = others.softmax(dim=-1)  # [Hkv, L]
    if importance.shape[0] == 0:
        return redundancy * -(1 - lam)
    imp = importance.float()
    imp = imp / imp.sum(dim=-1, keepdim=True).clamp_min(_EPS)  # [Hkv, L], sums to 1
    return imp * lam - redundancy * (1 - lam)


SPEC = MethodSpec(
    name="rkv",
    family="physical_eviction",
    description="during decode, every rkv_interval tokens compress back to the budget by "
    "recent-window attention minus key redundancy (cosine), per KV head",
    method=RKV,
    knobs=RKVKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
)
