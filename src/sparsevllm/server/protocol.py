"""Request bodies of the OpenAI-compatible API (pydantic models) and their sampling params.

Validation is strict: a number sent as a string, a float where an integer belongs or a
boolean where a number belongs is rejected (OpenAI's own API rejects them too), and
unknown top-level fields are rejected with their name, because a misspelt
``temprature`` would otherwise quietly sample at the default temperature. Optional
fields accept ``null``, which some clients send for "not set".
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sparsevllm.sampling import MAX_LOGPROBS, SamplingParams
from sparsevllm.server.errors import bad_request, from_value_error
from sparsevllm.server.structured import (
    GUIDED_FIELDS,
    ResponseFormat,
    StructuredOutputsBody,
    StructuredRequest,
    resolve_structured,
)
from sparsevllm.server.tools import (
    Function,
    ToolRequest,
    check_tool_choice,
    template_tool_calls,
    tool_choice_kind,
)

# OpenAI's documented maximum for n.
MAX_N = 128
# Chain ids (chain cache): echoed in a response header, so visible ASCII only.
MAX_CHAIN_ID_LEN = 128
CHAIN_ID_HEADER = "X-SparseVLLM-Chain-ID"
_CHAIN_ID_CHARS = re.compile(r"[\x21-\x7e]+")
# Temperatures below this sample greedily (as vLLM does): dividing logits by a
# denormal-small temperature overflows them to inf, and the softmax to NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 128  # OpenAI's limit on `tools`
TokenId = Annotated[int, Field(ge=0)]  # the vocabulary's upper bound is checked by the engine
# One stop string: non-empty (an empty one would stop at once), and bounded.
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
# What the JSON schema says of a chain id (check_chain_id enforces it, with a clearer
# message than a pattern mismatch); outside an anyOf, so it constrains strings only.
CHAIN_ID_SCHEMA: dict[str, Any] = {
    "minLength": 1,
    "maxLength": MAX_CHAIN_ID_LEN,
    "pattern": "^[\\x21-\\x7e]+$",
}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    """`stream_options`: `include_usage` adds a final chunk with the usage."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # accepted for vLLM clients; ignored


# A sparse-method setting's value in a request (the method's knob types; a tuple knob
# as a list of integers).
KnobValue = int | float | bool | str | list[Annotated[int, Field(ge=0)]]


class SparseFields(StrictModel):
    """The request's KV sparsity: a method among those the engine serves and its budget
    (`SamplingParams.sparse_method`, `kv_budget`, `min_accuracy`, `sparse_knobs`)."""

    sparse_method: str | None = Field(None, min_length=1, max_length=64)
    kv_budget: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    min_accuracy: float | None = Field(None, gt=0.0, le=1.0)
    sparse_knobs: dict[str, KnobValue] | None = Field(None, max_length=64)

    def sparse_values(self) -> dict[str, Any]:
        """The fields as SamplingParams keyword arguments (unset ones left out)."""
        values = {
            "sparse_method": self.sparse_method,
            "kv_budget": self.kv_budget,
            "min_accuracy": self.min_accuracy,
            "sparse_knobs": self.sparse_knobs,
        }
        return {k: v for k, v in values.items() if v is not None}


class SamplingFields(SparseFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI clients send it
    # Only null or {} (not supported); the schema says so, the validator says why.
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    max_tokens: int | None = Field(None, ge=1)
    # Chain cache: the conversation this request continues.
    chain_id: str | None = Field(None, json_schema_extra=CHAIN_ID_SCHEMA)
    # Structured outputs (server/structured.py): one of these per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("chain_id")
    @classmethod
    def _chain_id(cls, value: str | None) -> str | None:
        if value is not None:
            check_chain_id(value, "chain_id")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def structured(self) -> StructuredRequest:
        """The output constraint and the field that gave it (400 when malformed)."""
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        return resolve_structured(self.response_format, self.structured_outputs, guided)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (n=1: the server fans `n` out itself)."""
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": engine_temperature(self.temperature),
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "structured_outputs": self.structured().params,
            **self.sparse_values(),
        }
        given = {k: v for k, v in values.items() if v is not None}
        try:
            return SamplingParams(**given)
        except ValueError as e:
            raise from_value_error(e) from None

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # only equal to n (no reranking)
    # Only null or "" (no insertion mode).
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ValueError("best_of different from n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported (no prompt logprobs)")
        return self

    def max_tokens_or_default(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default


class TextPart(StrictModel):
    """A text part of a message's content (the only part type served)."""

    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object's text


class ToolCallIn(StrictModel):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictModel):
    """One chat message; `content` is text or a list of text parts (null only for an
    assistant message that makes tool calls)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only with an assistant's tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content or ""
        texts = content if isinstance(content, str) else [p.text for p in content]
        message: dict[str, Any] = template_message(self.role, texts)
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls(
                [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls]
            )
        return message


# OpenAI's rule for function names (both APIs).
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class FunctionSpec(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_function(self) -> Function:
        return Function(self.name, self.description, self.parameters, self.strict)


class ToolSpec(StrictModel):
    """One entry of `tools`: a function the model may call."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


def engine_temperature(value: float | None) -> float:
    """OpenAI's default of 1; below GREEDY_TEMPERATURE, greedy decoding (0)."""
    temperature = 1.0 if value is None else value
    return 0.0 if temperature < GREEDY_TEMPERATURE else temperature


def template_message(role: str, content: str | list[str]) -> dict[str, str]:
    """A message as chat templates take it: text parts joined by newlines, and the
    "developer" role as "system" (templates predate it; it means the same)."""
    text = content if isinstance(content, str) else "\n".join(content)
    return {"role": "system" if role == "developer" else role, "content": text}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = True
    # Tool calling (server/tools.py): functions the model may call.
    tools: Annotated[list[ToolSpec], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        names = [t.function.name for t in self.tools or []]
        check_tool_choice(names, tool_choice_kind(self.tool_choice), self._named())
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send only one")
        return self

    def _named(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def tool_request(self) -> ToolRequest | None:
        """The tools and tool choice (server/tools.py); None without tools."""
        if not self.tools:
            return None
        return ToolRequest(
            tuple(t.function.as_function() for t in self.tools),
            tool_choice_kind(self.tool_choice),
            self._named(),
            constrained=self.structured().params is not None,
        )

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the new name) or max_tokens; None: up to max_model_len."""
        return self.max_completion_tokens or self.max_tokens

    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(StrictModel):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: special tokens (e.g. BOS) for a prompt; the chat template writes
    # its own, so none are added to messages.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt and messages: give exactly one of them")
        return self


class DetokenizeRequest(StrictModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


def check_context_length(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    field: str,
    prompt_param: str,
) -> int:
    """Return max_tokens (defaulting to the room left); 400 when the request cannot fit."""
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens, but this model's maximum context "
            f"length is {max_model_len} tokens (prompt and output together)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{num_prompt_tokens} prompt tokens and asks for up to {max_tokens} output tokens "
            f"({num_prompt_tokens + max_tokens} in all): lower {field} to at most {room}",
            param=field,
            code="context_length_exceeded",
        )
    return max_tokens


def check_chain_id(value: str, source: str) -> None:
    """Raise ValueError unless `value` is a valid chain id (`source` names where it came from)."""
    if not 1 <= len(value) <= MAX_CHAIN_ID_LEN or not _CHAIN_ID_CHARS.fullmatch(value):
        raise ValueError(
            f"{source} must be 1 to {MAX_CHAIN_ID_LEN} visible ASCII characters "
            f"(no spaces or control characters)"
        )
