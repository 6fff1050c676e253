"""TOVA (Oren et al., 2024): token omission via attention.

Whenever a layer holds more than `decode_keep_tokens` tokens, it keeps those the
current query (the step's last token) attends to most, averaged over all heads; the
same tokens for every head of the layer. A prompt is cut once, at its end, with its last
query's attention (whatever its chunking: the selection must not depend on
chunk_prefill_size); decode steps then evict one token at a time, as the paper does.

`tova_decode_eviction=False` stops after the prompt's cut: generated tokens are kept, as
in kvpress's `TOVAPress` (which compresses the prompt only). That is the setting to
compare with kvpress: evicting while the answer is generated can drop a needle token the
query of an earlier answer token did not attend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, RowScores, SeqStep, SparseMethod
from sparsevllm.sparse.spec import MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class TOVAKnobs(MethodKnobs):
    tova_decode_eviction: bool = knob(
        True,
        "Evict one token per decode step once over budget (the paper); off: cut the prompt "
        "once and keep every generated token (kvpress's TOVAPress).",
    )


class TOVA(SparseMethod):
    # True whatever the knob: the engine asks the class (a step is never scheduled ahead).
    evicts_during_decode = True
    model_heads = True  # the head average spans every query head
    name = "tova"
    per_layer_groups = True
    knobs: TOVAKnobs

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        # The whole prompt until its end; then the budget, plus a chunk of generated
        # tokens computed again after a preemption.
        budget = self.config.decode_keep_tokens
        if not self.knobs.tova_decode_eviction:  # the prompt, then budget + generated
            return max(prompt_len, min(prompt_len, budget) + max_tokens)
        chunk = self.config.chunk_prefill_size
        bound = max(prompt_len, budget) + chunk
        return min(prompt_len + max_tokens, bound)

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        budget = self.config.decode_keep_tokens
        if not self.knobs.tova_decode_eviction:
            return min(prompt_len, budget) + max_tokens
        return min(prompt_len + max_tokens, budget + 1)

    def decode_score_rows(self) -> int:
        return 1 if self.knobs.tova_decode_eviction else 0

    def prefill_score_rows(self, step: SeqStep) -> int:
        # The chunk's last query, once the prompt ends (a recomputation's later chunks
        # hold generated tokens, each of which evicted when it was decoded).
        return 1 if self._selects(step) else 0

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        budget = self.config.decode_keep_tokens
        for step in steps:
            if not self._selects(step):
                continue
            for layer, rows in scores.items():
                attn = rows[step.row]  # [num_heads, L]
                if attn is None or attn.shape[-1] <= budget:
                    continue
                kv.keep(step.seq_id, kv.group_of(layer), tova_keep(attn, budget))

    def _selects(self, step: SeqStep) -> bool:
        """A step that cuts back: the end of the prompt, or (with decode eviction) any
        later step. A recomputed prompt's later chunks hold generated tokens: without
        decode eviction they were never cut, so they are not cut now either."""
        if step.finishes_prompt:
            return True
        return step.is_decode and self.knobs.tova_decode_eviction


def tova_keep(attn: torch.Tensor, budget: int) -> list[int]:
    """Positions of the `budget` tokens with the highest head-averaged attention."""
    return sorted(attn.float().mean(dim=0).topk(budget).indices.tolist())


SPEC = MethodSpec(
    name="tova",
    family="physical_eviction",
    description="evict the tokens the current query attends to least (head average)",
    method=TOVA,
    knobs=TOVAKnobs,
    budget_fields=("decode_keep_tokens",),
    budget_knob="decode_keep_tokens",
    chain_cache=True,
)
