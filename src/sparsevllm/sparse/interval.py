"""Eviction in bursts during decode: a layer may grow `interval` tokens past its budget
before the method compresses it back (H2O, R-KV). A prompt is selected from once, at its
end, whatever its chunking (a method defined over the whole prompt must not depend on
chunk_prefill_size); only its generated tokens are evicted in bursts. A subclass with
`bounded_prefill` also cuts a bounded sequence's prompt after every chunk but the last
(ScoreEviction.cuts_chunk)."""

from __future__ import annotations

from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction


class IntervalEviction(ScoreEviction):
    """A ScoreEviction whose subclass sets `budget` and `interval`: the whole prompt stays
    resident until its end, then the pool reserves budget + interval per layer, plus a
    chunk while generated tokens are computed again after a preemption."""

    evicts_during_decode = True
    budget: int
    interval: int

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        chunk = self.config.chunk_prefill_size
        bound = max(prompt_len + chunk, self.budget + self.interval + chunk)
        return min(prompt_len + max_tokens, bound)

    def bounded_resident(self, prompt_len: int, max_tokens: int) -> int:
        # Cut back to the budget after every chunk (bounded_prefill subclasses): a chunk
        # peaks at budget + chunk, below decode's budget + interval (+ a chunk after a
        # preemption).
        chunk = self.config.chunk_prefill_size
        return min(prompt_len + max_tokens, self.budget + self.interval + chunk)

    def should_compress(self, step: SeqStep, resident: int, layer: int) -> bool:
        if step.finishes_prompt or self.cuts_chunk(step):
            return resident > self.budget
        # Mid-prompt chunks only vote: the selection happens once, at the prompt's end.
        return step.is_decode and resident > self.budget + self.interval

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        return min(prompt_len + max_tokens, self.budget + self.interval)
