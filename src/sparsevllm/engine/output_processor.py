"""Sampled tokens -> request state and outputs: detokenization, stop tokens, stop strings,
finish reasons and the text deltas a stream reports (torch-free)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sparsevllm.engine.detokenizer import IncrementalDetokenizer, truncate_at_stop
from sparsevllm.engine.sequence import Sequence
from sparsevllm.outputs import RequestOutput, request_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sparsevllm.layers.sampler import TokenLogprobs


class OutputProcessor:
    """Per request: an incremental detokenizer and how much text was reported already."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._emitted: dict[int, int] = {}
        self.num_generated_tokens = 0
        # Called with each request's newly sampled token (tracing, fault injection).
        self.token_observers: list[Callable[[Sequence, int], None]] = []

    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self._detok[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
        self._emitted[seq.seq_id] = 0

    def forget(self, seq: Sequence) -> None:
        self._detok.pop(seq.seq_id, None)
        self._emitted.pop(seq.seq_id, None)

    def append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Add a sampled token to `seq`; returns the finish reason it causes, if any (the
        caller finishes the request)."""
        now = time.perf_counter()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.output_token_ids.append(token)
        for observe in self.token_observers:
            observe(seq, token)
        if seq.grammar is not None:  # raises on a token the grammar forbids: fails seq
            seq.grammar.accept(token)
        if seq.params.logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self.num_generated_tokens += 1
        detok = self._detok.get(seq.seq_id)
        if detok is not None:
            detok.add(token)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            if detok is not None:
                detok.flush()  # release text held back for an incomplete character
            seq.metrics.finished_time = now
        return reason

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if seq.grammar is not None and seq.grammar.is_finished:
            return "stop"  # the constraint is complete (or took EOS): nothing may follow
        if n_out >= p.min_tokens:
            if token in (p.stop_token_ids or ()):
                seq.stop_reason = token
                return "stop"
            if not p.ignore_eos and token in seq.eos_token_ids:
                return "stop"
            detok = self._detok.get(seq.seq_id)
            if p.stop and detok is not None:
                _, matched = truncate_at_stop(
                    detok.text, p.stop, p.include_stop_str_in_output, self._emitted[seq.seq_id]
                )
                if matched is not None:
                    seq.stop_reason = matched
                    return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _text(self, seq: Sequence) -> str:
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            return ""
        text = detok.text
        if seq.params.stop:
            text, _ = truncate_at_stop(
                text, seq.params.stop, seq.params.include_stop_str_in_output, 0
            )
        return text

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output now, with the text added since the last one as delta."""
        text = self._text(seq)
        prev = self._emitted.get(seq.seq_id, 0)
        self._emitted[seq.seq_id] = len(text)
        return request_output(seq, text, text[prev:])
