"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
