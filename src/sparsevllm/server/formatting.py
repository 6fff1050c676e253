"""From RequestOutputs to OpenAI bodies: choices, stream deltas, logprobs, usage, SSE."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.engine.detokenizer import releasable_prefix
from sparsevllm.outputs import RequestOutput

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -inf; vLLM reports impossible tokens with this floor instead.
_LOGPROB_FLOOR = -9999.0
_TOKEN_CACHE_SIZE = 200_000


@dataclass
class PromptInput:
    """A tokenized prompt; `text` is kept for echo (None for token-id prompts)."""

    token_ids: list[int]
    text: str | None = None


@dataclass
class Choice:
    """One choice of a response (one engine request) and what of it was streamed."""

    index: int
    prompt_index: int
    request_id: str
    stop: list[str] = field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    final: RequestOutput | None = None

    def text_delta(self, out: RequestOutput) -> str:
        """New text that is safe to send.

        While a request runs, its text may end with the beginning of a stop string
        ("... w5" with stop "w5 w6"); if the stop string completes, the engine cuts the
        text before it, so sending that tail early would make the streamed text differ
        from the final text. It is held back until it can no longer become a match.
        """
        end = len(out.text)
        if not out.finished and self.stop:
            end = releasable_prefix(out.text, self.stop)
        if end <= self.sent_chars:
            return ""
        delta = out.text[self.sent_chars : end]
        self.sent_chars = end
        return delta

    def new_tokens(self, out: RequestOutput) -> tuple[list[int], list[Any]]:
        """Token ids (and logprob entries) not yet reported for this choice."""
        ids = out.token_ids[self.sent_tokens :]
        entries = (out.logprobs or [])[self.sent_tokens :]
        self.sent_tokens = len(out.token_ids)
        return ids, entries


class TokenStrings:
    """Token id -> its text as reported in logprobs (decoded alone, specials kept)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode(
                    [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            if len(self._cache) < _TOKEN_CACHE_SIZE:
                self._cache[token_id] = text
        return text


def safe_logprob(value: float) -> float:
    return value if math.isfinite(value) else _LOGPROB_FLOOR


def completion_logprobs(
    choice: Choice, token_ids: list[int], entries: list[Any], strings: TokenStrings
) -> dict[str, list[Any]]:
    """OpenAI completions format; advances `choice.text_offset`."""
    result: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(token_ids, entries):
        text = strings(token_id)
        logprob = safe_logprob(entry.logprob)
        top = {strings(t): safe_logprob(lp) for t, lp in entry.top_logprobs}
        top.setdefault(text, logprob)  # the sampled token is always listed, as in vLLM
        result["tokens"].append(text)
        result["token_logprobs"].append(logprob)
        result["top_logprobs"].append(top)
        result["text_offset"].append(choice.text_offset)
        choice.text_offset += len(text)
    return result


def chat_logprobs(
    token_ids: list[int], entries: list[Any], top_n: int, strings: TokenStrings
) -> dict[str, Any]:
    """OpenAI chat format: {"content": [{token, logprob, bytes, top_logprobs}], ...}."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = strings(token_id)
        return {"token": text, "logprob": safe_logprob(logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries):
        top = [item(t, lp) for t, lp in entry.top_logprobs[:top_n]]
        content.append({**item(token_id, entry.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def usage(prompts: list[PromptInput], choices: list[Choice]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI counts them."""
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.final.token_ids) for c in choices if c.final is not None)
    cached: dict[int, int] = {}
    for c in choices:
        if c.final is not None:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.final.num_cached_tokens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"
