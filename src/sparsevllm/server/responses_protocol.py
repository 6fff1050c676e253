"""Request body of POST /v1/responses (OpenAI's Responses API) and its conversation.

The input is a string (one user message) or a list of message items; the messages that
reach the chat template are the stored conversation of `previous_response_id` (if any),
then this request's input, with `instructions` as a leading system message of this
request only (OpenAI does not carry instructions over to the next response).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from sparsevllm.sampling import SamplingParams
from sparsevllm.server.errors import APIError, bad_request, from_value_error
from sparsevllm.server.protocol import StrictModel, engine_temperature, template_message
from sparsevllm.server.structured import (
    JsonSchemaFormat,
    ResponseFormat,
    StructuredRequest,
    resolve_structured,
)

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_VALUE = 512


class InputText(StrictModel):
    """A text part of an input message (`output_text`: an earlier assistant reply)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text parts echo them; ignored


class InputMessage(StrictModel):
    """One message of `input`: text, or a list of text parts."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None  # echoed output items carry theirs; ignored
    status: str | None = None

    def as_template_input(self) -> dict[str, str]:
        texts = self.content if isinstance(self.content, str) else [p.text for p in self.content]
        return template_message(self.role, texts)


class TextFormat(StrictModel):
    """`text.format`: plain text, any JSON object, or JSON that matches `schema` (the
    Responses API puts name and schema here, where chat's `response_format` nests them)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None):
            raise ValueError("text.format: name is required with type 'json_schema' only")
        if self.type != "json_schema" and self.schema_ is not None:
            raise ValueError("text.format: schema goes with type 'json_schema'")
        return self

    def as_response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        schema = JsonSchemaFormat.model_validate(
            {"name": self.name, "schema": self.schema_, "strict": self.strict}
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


class TextOptions(StrictModel):
    """`text`: the output's format."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ResponsesRequest(StrictModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = None  # accepted and ignored, as OpenAI clients send it
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    # Tool calling is not served by this endpoint yet: only an empty tool list passes.
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None  # accepted and ignored
    # vLLM's extras: greedy decoding checks and reproducible samples.
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be an empty list")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS or any(len(v) > MAX_METADATA_VALUE for v in meta.values()):
            raise ValueError(
                f"metadata holds at most {MAX_METADATA_KEYS} keys with values of at most "
                f"{MAX_METADATA_VALUE} characters"
            )
        return self

    def input_messages(self) -> list[dict[str, str]]:
        """This request's input as chat-template messages (no instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.as_template_input() for m in self.input]

    def structured(self) -> StructuredRequest:
        """The output constraint of `text.format` (a 400 naming `text` when malformed)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return StructuredRequest()
        try:
            resolved = resolve_structured(fmt.as_response_format(), None, {})
        except APIError as e:  # worded for chat's response_format
            raise bad_request(e.message.replace("response_format", "text.format"), "text") from None
        return StructuredRequest(resolved.params, "text" if resolved.params else None)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        values: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": engine_temperature(self.temperature),
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "structured_outputs": self.structured().params,
        }
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None})
        except ValueError as e:
            raise from_value_error(e) from None
