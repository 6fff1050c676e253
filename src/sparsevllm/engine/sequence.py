"""Per-request state shared by the scheduler, the engine and the runner (torch-free)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparsevllm.sampling import SamplingParams
from sparsevllm.sparse.choice import MethodChoice

if TYPE_CHECKING:
    from sparsevllm.engine.structured import GrammarState
    from sparsevllm.layers.sampler import TokenLogprobs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class Sequence:
    """One request: its tokens, its progress and its place in the KV pool.

    `num_computed_tokens` counts logical tokens whose KV has been computed (positions
    keep counting even when a sparse method evicts their slots).
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    chain_id: str | None = None  # chain cache: the conversation this request extends
    chain_status: str | None = None
    parked: bool = False  # finished, its state kept as an idle chain
    grammar: GrammarState | None = None  # structured outputs: advanced with each token
    method: MethodChoice | None = None  # the sparse method serving it (None: the engine's)
    # Its method cuts the KV between prompt chunks (EngineConfig.bounded_prefill): always
    # chunked, counted by admission at budget + chunk per layer.
    bounded_prefill: bool = False
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the newest token still lacks KV (prompt or recompute)."""
        return self.num_uncomputed_tokens > 1

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
