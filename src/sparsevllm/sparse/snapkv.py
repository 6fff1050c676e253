"""SnapKV (Li et al., 2024): the last prompt queries vote for the tokens to keep.

At the end of prefill, every resident token is scored by the softmax attention it
receives from the last `snapkv_window_size` prompt queries (summed over the window,
averaged over the query heads of each KV head, optionally max-pooled along the
sequence), and each KV head keeps sink + top-k + recent tokens: `decode_keep_tokens`
in all. Decode tokens are appended without further eviction.

Window queries may fall in several prefill chunks; their probabilities are summed as
the chunks run (a query's causal mask only sees keys that exist when it runs), so the
result does not depend on the chunk size.

Bounded prefill (`SeqStep.bounded`, EngineConfig.bounded_prefill): a prompt of N tokens
runs with at most B + C resident tokens per layer (B the layer's budget, C
`chunk_prefill_size`), for any N. With w = `snapkv_window_size`, the prompt's
observation window is its last w queries, positions [N - w, N). Per layer:

1. A chunk [s, e) with e > N - w adds the probabilities of its queries in the window to
   the layer's window votes, as above.
2. At the end of a chunk with e < N (not the prompt's last) a layer holding more than B
   tokens is cut to B: sink + recent + the top of the middle, per KV head, by the pooled
   votes of (a) the chunk's last min(w, e - s) queries (a moving observation window:
   the only queries there are then) if e <= N - w, or (b) the window votes so far if the
   chunk reaches into the window. The window votes follow the cut (each query head's
   votes gathered by its KV head's kept positions).
3. At the chunk with e = N, the selection above (its window votes over what is resident).

A layer then holds at most B before each chunk. Chunks are cut only where a layer holds
more than B after them, so when B covers the prompt nothing is evicted and the tokens
equal unbounded prefill's; when no chunk before the last crosses B, only step 3 selects,
exactly as unbounded. Otherwise the selection depends on where chunks end (they end at
multiples of chunk_prefill_size unless the step's token budget cuts one short).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction, add_padded, follow_keep, gqa_mean
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class SnapKVKnobs(MethodKnobs):
    snapkv_window_size: int = knob(
        32, "SnapKV/PyramidKV: number of last prompt queries that score tokens.", minimum=1
    )
    snapkv_pool_kernel_size: int = knob(
        7, "SnapKV/PyramidKV: max-pooling kernel over scores (1: none).", minimum=1
    )


class SnapKV(ScoreEviction):
    name = "snapkv"
    knobs: SnapKVKnobs
    bounded_prefill = True

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        # seq_id -> layer -> [num_kv_heads, L] window attention summed so far, averaged
        # over each KV head's query heads as it arrives (the votes average them anyway),
        # so a step of many prompt ends holds a quarter of the rows (Llama-3-8B's GQA)
        self._window: dict[int, dict[int, torch.Tensor]] = {}

    def in_window(self, step: SeqStep) -> bool:
        """The step computes some of the prompt's last `snapkv_window_size` queries."""
        return step.end > step.prompt_len - self.knobs.snapkv_window_size

    def prefill_score_rows(self, step: SeqStep) -> int:
        if step.is_decode:
            return 0
        if self.in_window(step):
            return step.end - max(step.start, step.prompt_len - self.knobs.snapkv_window_size)
        # A bounded chunk that may be cut (a layer holds at most step.end tokens): its last
        # queries are the moving observation window (rule 2a of the module docstring).
        smallest = min(self.layer_budget(layer) for layer in self.layers)
        if self.cuts_chunk(step) and step.end > smallest:
            return min(self.knobs.snapkv_window_size, step.num_new)
        return 0

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            if self.score_rows(step) == 0 or not self.in_window(step):
                continue  # a moving window's votes serve its own chunk's cut only
            acc = self._window.setdefault(step.seq_id, {})
            for layer, rows in scores.items():
                attn = rows[step.row]  # [num_heads, L] of this chunk's window queries
                if attn is not None:
                    votes = gqa_mean(attn.float(), self.num_kv_heads)  # [num_kv_heads, L]
                    prev = acc.get(layer)  # votes is a new tensor: kept as it is
                    acc[layer] = votes if prev is None else add_padded(prev, votes)
        super().after_step(steps, scores, kv)
        for step in steps:
            if step.finishes_prompt:
                self._window.pop(step.seq_id, None)

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        if self.in_window(step):
            votes = self._window[step.seq_id][layer]  # [num_kv_heads, L]
        else:  # a bounded chunk before the window: its moving window's rows
            assert attn is not None, "a bounded chunk is cut with the scores it asked for"
            votes = attn  # [num_heads, L]
        return snapkv_scores(votes, self.num_kv_heads, self.knobs.snapkv_pool_kernel_size)

    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        # A cut before the prompt's end: the window votes so far follow the kept tokens.
        window = self._window.get(seq_id, {})
        if layer in window:
            window[layer] = follow_keep(window[layer], keep)

    def release(self, seq_id: int) -> None:
        self._window.pop(seq_id, None)


def snapkv_scores(window_attn: torch.Tensor, num_kv_heads: int, kernel: int) -> torch.Tensor:
    """`[num_heads, L]` summed window attention -> `[num_kv_heads, L]` pooled votes."""
    votes = gqa_mean(window_attn.float(), num_kv_heads)
    if kernel > 1:
        votes = F.max_pool1d(votes.unsqueeze(0), kernel, stride=1, padding=kernel // 2)[0]
        votes = votes[:, : window_attn.shape[-1]]
    return votes


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """SnapKV's vote over a cached history, which keeps keys but no queries: the keys of
    its last `snapkv_window_size` resident entries stand in for the observation queries
    (causal by logical position, summed over the window, max-pooled along the view).
    Queries and keys of a token come from the same hidden state, so its key is the
    closest stand-in the cache holds; the end of the history is what the next turn
    continues from, as SnapKV's prompt end is. keys `[L, Hkv, D]` -> `[Hkv, L]`."""
    assert isinstance(knobs, SnapKVKnobs)
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    w = min(knobs.snapkv_window_size, k.shape[1])
    q = k[:, -w:]  # [Hkv, w, D]: the last entries' keys as observation queries
    logits = q @ k.transpose(1, 2) / math.sqrt(k.shape[-1])  # [Hkv, w, L]
    future = positions[:, None, :] > positions[:, -w:, None]  # [Hkv, w, L]
    attn = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
    return snapkv_scores(attn.sum(dim=1), k.shape[0], knobs.snapkv_pool_kernel_size)


SPEC = MethodSpec(
    name="snapkv",
    family="physical_eviction",
    description="at prefill end keep sink + recent + the tokens the last prompt queries "
    "attend to most, per KV head",
    method=SnapKV,
    knobs=SnapKVKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
