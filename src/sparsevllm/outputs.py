"""What the engine returns for a request, in vLLM's shapes.

A `RequestOutput` holds the prompt and a list of `CompletionOutput`s, one per sample
(`SamplingParams.n`), as vLLM's offline API does: `outputs[0].outputs[0].text`. The
engine runs every sample as its own request, so what it reports has one completion;
`LLM.generate` gathers the n samples of a prompt into one `RequestOutput`.

For the single-completion case, `RequestOutput` also answers `text`, `token_ids`,
`finish_reason`, `stop_reason`, `logprobs`, `cumulative_logprob` and `text_delta`
directly, and take assignments (they are those of `outputs[0]`); with several
completions these raise a ValueError that points at `outputs[i]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparsevllm.engine.sequence import Sequence
    from sparsevllm.layers.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    """One completion (sample) of a request.

    `logprobs` (when requested) holds one `TokenLogprobs` per generated token: the
    chosen token's logprob and the top-N alternatives; `cumulative_logprob` is the sum
    of the chosen tokens' logprobs (None when logprobs were not requested).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    text_delta: str = ""  # text added since the previous output of this request

    def finished(self) -> bool:
        return self.finish_reason is not None


class _OnlyCompletion:
    """A CompletionOutput field read and written through its RequestOutput, for the
    single-completion case (`out.text` is `out.outputs[0].text`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: RequestOutput | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._only(self.name), self.name)

    def __set__(self, obj: RequestOutput, value: Any) -> None:
        setattr(obj._only(self.name), self.name, value)


@dataclass
class RequestOutput:
    """The state of one request: complete when `finished`, partial while streaming.

    `metrics` holds `time_to_first_token` (s), `decode_tokens_per_s`, `e2e_latency` (s)
    and `num_preemptions`; for several completions, the earliest first token, the
    latest end, and the decode rates and preemptions summed over the completions.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    chain_id: str | None = None  # chain cache: the conversation to continue next turn
    chain_status: str | None = None  # continued | new | not_found | diverged: ...
    prompt_logprobs: None = None  # vLLM's field; prompt logprobs are not computed

    @classmethod
    def single(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        text: str,
        token_ids: list[int],
        finished: bool,
        finish_reason: str | None = None,
        **fields: Any,
    ) -> RequestOutput:
        """A one-completion output; `fields` are RequestOutput's other fields or the
        completion's `stop_reason`, `logprobs`, `cumulative_logprob`, `text_delta`."""
        names = ("stop_reason", "logprobs", "cumulative_logprob", "text_delta")
        completion = {k: fields.pop(k) for k in names if k in fields}
        out = CompletionOutput(0, text, token_ids, finish_reason=finish_reason, **completion)
        return cls(request_id, prompt, prompt_token_ids, [out], finished, **fields)

    def _only(self, name: str) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise ValueError(
                f"this request has {len(self.outputs)} completions: read "
                f"outputs[i].{name} instead of .{name}"
            )
        return self.outputs[0]

    text = _OnlyCompletion()
    token_ids = _OnlyCompletion()
    finish_reason = _OnlyCompletion()
    stop_reason = _OnlyCompletion()
    logprobs = _OnlyCompletion()
    cumulative_logprob = _OnlyCompletion()
    text_delta = _OnlyCompletion()


def request_output(seq: Sequence, text: str, text_delta: str) -> RequestOutput:
    """A request's current state as an output (`text` already cut at a stop string)."""
    m = seq.metrics
    decode_rate = None
    if m.finished_time and m.first_token_time and len(seq.output_token_ids) > 1:
        span = m.finished_time - m.first_token_time
        decode_rate = (len(seq.output_token_ids) - 1) / span if span > 0 else None
    logprobs = list(seq.output_logprobs) if seq.params.logprobs is not None else None
    return RequestOutput.single(
        seq.request_id,
        seq.prompt,
        seq.prompt_token_ids,
        text,
        list(seq.output_token_ids),
        seq.is_finished,
        seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=logprobs,
        cumulative_logprob=sum(e.logprob for e in logprobs) if logprobs is not None else None,
        text_delta=text_delta,
        num_cached_tokens=seq.num_cached_tokens,
        error=seq.error,
        metrics={
            "time_to_first_token": m.time_to_first_token,
            "decode_tokens_per_s": decode_rate,
            "e2e_latency": (m.finished_time - m.arrival_time) if m.finished_time else None,
            "num_preemptions": seq.num_preemptions,
        },
        chain_id=seq.chain_id,
        chain_status=seq.chain_status,
    )


def merge_samples(samples: list[RequestOutput]) -> RequestOutput:
    """The n finished samples of one prompt (each a one-completion output) as one
    RequestOutput with n completions, indexed in order."""
    first = samples[0]
    completions = [s.outputs[0] for s in samples]
    for i, c in enumerate(completions):
        c.index = i
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(s.finished for s in samples),
        num_cached_tokens=first.num_cached_tokens,
        error=next((s.error for s in samples if s.error), None),
        metrics=_merged_metrics([s.metrics for s in samples]),
        chain_id=first.chain_id,
        chain_status=first.chain_status,
    )


def _merged_metrics(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    def values(key: str) -> list[Any]:
        return [m[key] for m in metrics if m.get(key) is not None]

    ttft, e2e, rates = (
        values("time_to_first_token"),
        values("e2e_latency"),
        values("decode_tokens_per_s"),
    )
    return {
        "time_to_first_token": min(ttft) if ttft else None,
        "decode_tokens_per_s": sum(rates) if rates else None,
        "e2e_latency": max(e2e) if e2e else None,
        "num_preemptions": sum(values("num_preemptions")),
    }
