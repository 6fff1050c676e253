"""`ScoreEviction`: the shared selection of score-based eviction methods (score every
resident token per KV head, keep sink + the top-scoring middle + recent), and the score
helpers they share (GQA head averaging, accumulating scores over growing views, keeping
per-query-head scores aligned with a per-KV-head compaction).

A subclass that declares `bounded_prefill` is also cut back to its budget at the end of
every prompt chunk of a bounded sequence (`SeqStep.bounded`) but the last, once a layer
holds more than the budget: before each chunk a layer then holds at most its budget, so
its peak is budget + chunk (`bounded_resident`). Its `score` says what votes then."""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import KVAccess, RowScores, SeqStep, SparseMethod


def gqa_mean(scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[num_heads, L]` -> `[num_kv_heads, L]`: mean over each KV head's query heads."""
    h, length = scores.shape
    return scores.view(num_kv_heads, h // num_kv_heads, length).mean(dim=1)


def add_padded(acc: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """Sum score vectors of different lengths (a later chunk sees more keys)."""
    if acc is None:
        return new.float().clone()
    out = new.float().clone()
    out[:, : acc.shape[-1]] += acc
    return out


def follow_keep(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-query-head scores `[num_heads, L]` after a compaction that kept `keep`
    (`[num_kv_heads, B]` view positions): `[num_heads, B]`, each query head following its
    KV head's selection. Positions past L (tokens newer than the scores) score 0."""
    h, length = scores.shape
    keep = keep.to(scores.device).long()
    width = max(length, int(keep.max()) + 1) if keep.numel() else length
    padded = torch.nn.functional.pad(scores, (0, width - length))  # [H, width]
    index = keep.repeat_interleave(h // keep.shape[0], dim=0)  # [H, B]
    return padded.gather(1, index)


def select_keep(scores: torch.Tensor, budget: int, sink: int, recent: int) -> torch.Tensor:
    """Per-head keep set: sink + recent always, then the top-scoring middle tokens.

    scores: `[H, L]` (higher is kept). Returns `[H, min(budget, L)]` ascending positions.
    """
    h, length = scores.shape
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(h, length)
    sink = min(sink, budget)
    recent = min(recent, budget - sink)
    middle = budget - sink - recent
    parts = [torch.arange(sink, device=scores.device).expand(h, sink)]
    if middle > 0:
        mid_scores = scores[:, sink : length - recent]
        top = mid_scores.topk(middle, dim=-1).indices + sink
        parts.append(top)
    parts.append(torch.arange(length - recent, length, device=scores.device).expand(h, recent))
    return torch.cat(parts, dim=-1).sort(dim=-1).values


class ScoreEviction(SparseMethod):
    """Score every resident token per KV head and keep a budget (sink + top + recent).

    Subclasses implement `score` and may change when compression happens
    (`should_compress`) and the per-layer budget (`layer_budget`).
    """

    per_layer_groups = True

    def layer_budget(self, layer: int) -> int:
        return self.config.decode_keep_tokens

    def may_compress(self, step: SeqStep) -> bool:
        """Cheap per-step test before `should_compress` is asked for every layer (a decode
        step of a large batch would otherwise cost num_seqs x num_layers calls)."""
        return step.finishes_prompt or self.cuts_chunk(step)

    def should_compress(self, step: SeqStep, resident: int, layer: int) -> bool:
        cuts = step.finishes_prompt or self.cuts_chunk(step)
        return cuts and resident > self.layer_budget(layer)

    def cuts_chunk(self, step: SeqStep) -> bool:
        """A prompt chunk before the last of a bounded sequence: its end cuts every layer
        above its budget back to it (methods with `bounded_prefill` only)."""
        return self.bounded_prefill and step.bounded and step.end < step.prompt_len

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        # The whole prompt is resident until prefill ends; then budget + generated tokens.
        budget = max(self.layer_budget(layer) for layer in self.layers)
        return max(prompt_len, min(prompt_len, budget) + max_tokens)

    def bounded_resident(self, prompt_len: int, max_tokens: int) -> int:
        # Before every chunk a layer holds at most its budget (cut at the previous chunk's
        # end), so a chunk of at most chunk_prefill_size peaks at budget + chunk; then
        # budget + generated tokens, as unbounded.
        budget = max(self.layer_budget(layer) for layer in self.layers)
        peak = min(prompt_len, budget + self.config.chunk_prefill_size)
        return max(peak, min(prompt_len, budget) + max_tokens)

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        budget = max(self.layer_budget(layer) for layer in self.layers)
        return min(prompt_len, budget) + max_tokens

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        """`[num_kv_heads, L]` importance of each resident token (higher is kept).

        `attn` is this layer's `[num_heads, L]` score rows of the step (None when the
        method asked for none); a method that scores keys reads them itself
        (`kv.keys(step.seq_id, layer)`), so the others pay no gather."""
        raise NotImplementedError

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            if not self.may_compress(step):
                continue
            for layer in self.layers:
                resident = kv.resident(step.seq_id, layer)
                if not self.should_compress(step, resident, layer):
                    continue
                attn = scores.get(layer, [None] * (step.row + 1))[step.row]
                self.compress(layer, step, kv, attn)

    def compress(self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None) -> None:
        """Score one layer of the sequence and keep its budget per KV head."""
        s = self.score(layer, step, kv, attn)
        keep = select_keep(
            s,
            self.layer_budget(layer),
            self.config.sink_keep_tokens,
            self.config.recent_keep_tokens,
        )
        kv.keep_per_head(step.seq_id, layer, keep)
        self.on_compressed(step.seq_id, layer, keep)

    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        """Hook for methods with per-token state that must follow the compaction."""
