"""StreamingLLM (Xiao et al., 2023): attention sinks + a sliding window of recent tokens.

Every layer keeps the same tokens, so one slot table serves all layers. Eviction runs
after every step, during prefill chunks and decode alike, so a sequence never holds
more than sink + recent + (tokens of one step) slots.
"""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import KVAccess, RowScores, SeqStep, SparseMethod
from sparsevllm.sparse.spec import MethodKnobs, MethodSpec


class StreamingLLM(SparseMethod):
    evicts_during_decode = True
    name = "streamingllm"

    @property
    def budget(self) -> int:
        return self.config.sink_keep_tokens + self.config.recent_keep_tokens

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        step = max(self.config.chunk_prefill_size, 1)
        return min(prompt_len + max_tokens, self.budget + step)

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, self.budget + 1)

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        sink, recent = self.config.sink_keep_tokens, self.config.recent_keep_tokens
        layer = self.layers[0]  # one group holds every managed layer
        for step in steps:
            length = kv.resident(step.seq_id, layer)
            if length > sink + recent:
                kv.keep(step.seq_id, kv.group_of(layer), streaming_keep(length, sink, recent))


def streaming_keep(length: int, sink: int, recent: int) -> list[int]:
    """View positions StreamingLLM keeps out of `length`: the first `sink`, the last `recent`."""
    if length <= sink + recent:
        return list(range(length))
    return list(range(sink)) + list(range(length - recent, length))


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """Position only: a pruned range keeps its most recent tokens. `[Hkv, L]`."""
    return positions.float()


SPEC = MethodSpec(
    name="streamingllm",
    family="physical_eviction",
    description="keep attention sinks + a recent window; evict the rest in prefill and decode",
    method=StreamingLLM,
    budget_fields=("sink_keep_tokens", "recent_keep_tokens"),
    budget_knob="recent_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
