"""SnapKV (Li et al., 2024): the last prompt queries vote for the tokens to keep.

At the end of prefill, every resident token is scored by the softmax attention it
receives from the last `snapkv_window_size` prompt queries (summed over the window,
averaged over the query heads of each KV head, optionally max-pooled along the
sequence), and each KV head keeps sink + top-k + recent tokens: `decode_keep_tokens`
in all. Decode tokens are appended without further eviction.

Window queries may fall in several prefill chunks; their probabilities are summed as
the chunks run (a query's causal mask only sees keys that exist when it runs), so the
result does not depend on the chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsevllm.sparse.base import ScoreEviction, SeqStep, gqa_mean


class SnapKV(ScoreEviction):
    name = "snapkv"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # seq_id -> layer -> [num_heads, L] window attention summed so far
        self._window: dict[int, dict[int, torch.Tensor]] = {}

    def score_rows(self, step: SeqStep) -> int:
        window_start = step.prompt_len - self.config.snapkv_window_size
        if step.is_decode or step.end <= window_start:
            return 0
        return step.end - max(step.start, window_start)

    def after_step(self, steps, scores, kv):
        for step in steps:
            if self.score_rows(step) == 0:
                continue
            acc = self._window.setdefault(step.seq_id, {})
            for layer, rows in scores.items():
                acc[layer] = _add_padded(acc.get(layer), rows[step.row])
        super().after_step(steps, scores, kv)
        for step in steps:
            if step.finishes_prompt:
                self._window.pop(step.seq_id, None)

    def score(self, layer, step, kv, attn):
        window = self._window[step.seq_id][layer]  # [num_heads, L]
        return snapkv_scores(window, self.num_kv_heads, self.config.snapkv_pool_kernel_size)

    def release(self, seq_id: int) -> None:
        self._window.pop(seq_id, None)


def snapkv_scores(window_attn: torch.Tensor, num_kv_heads: int, kernel: int) -> torch.Tensor:
    """`[num_heads, L]` summed window attention -> `[num_kv_heads, L]` pooled votes."""
    votes = gqa_mean(window_attn.float(), num_kv_heads)
    if kernel > 1:
        votes = F.max_pool1d(votes.unsqueeze(0), kernel, stride=1, padding=kernel // 2)[0]
        votes = votes[:, : window_attn.shape[-1]]
    return votes


def _add_padded(acc: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Sum score vectors of different lengths (a later chunk sees more keys)."""
    if new is None:
        return acc
    if acc is None:
        return new.float().clone()
    out = new.float().clone()
    out[:, : acc.shape[-1]] += acc
    return out
