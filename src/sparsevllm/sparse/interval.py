"""Eviction in bursts during decode: a layer may grow `interval` tokens past its budget
before the method compresses it back (H2O, R-KV)."""

from __future__ import annotations

from sparsevllm.sparse.base import ScoreEviction


class IntervalEviction(ScoreEviction):
    """A ScoreEviction whose subclass sets `budget` and `interval`: the pool reserves
    budget + interval per layer, plus a chunk while a prompt (or a recomputation after a
    preemption) is prefilled before the layer is compressed."""

    evicts_during_decode = True
    budget: int
    interval: int

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        bound = self.budget + self.interval + self.config.chunk_prefill_size
        return min(prompt_len + max_tokens, bound)

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, self.budget + self.interval)
