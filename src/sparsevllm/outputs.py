"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparsevllm.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """The state of one request: complete when `finished`, partial while streaming.

    `metrics` holds `time_to_first_token` (s), `decode_tokens_per_s`, `e2e_latency` (s)
    and `num_preemptions`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    num_cached_tokens: int = 0
    logprobs: list[Any] | None = None
    error: str | None = None
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    text_delta: str = ""  # text added since the previous output of this request
    chain_id: str | None = None  # chain cache: the conversation to continue next turn
    chain_status: str | None = None  # continued | new | not_found | diverged: ...


def request_output(seq: Sequence, text: str, text_delta: str) -> RequestOutput:
    """A request's current state as an output (`text` already cut at a stop string)."""
    m = seq.metrics
    decode_rate = None
    if m.finished_time and m.first_token_time and len(seq.output_token_ids) > 1:
        span = m.finished_time - m.first_token_time
        decode_rate = (len(seq.output_token_ids) - 1) / span if span > 0 else None
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        text=text,
        token_ids=list(seq.output_token_ids),
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        error=seq.error,
        metrics={
            "time_to_first_token": m.time_to_first_token,
            "decode_tokens_per_s": decode_rate,
            "e2e_latency": (m.finished_time - m.arrival_time) if m.finished_time else None,
            "num_preemptions": seq.num_preemptions,
        },
        text_delta=text_delta,
        chain_id=seq.chain_id,
        chain_status=seq.chain_status,
    )
