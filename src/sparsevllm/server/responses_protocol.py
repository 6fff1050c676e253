"""Request body of POST /v1/responses (OpenAI's Responses API) and its conversation.

The input is a string (one user message) or a list of items: messages, earlier
`function_call`s and the `function_call_output`s that answer them. The messages that
reach the chat template are the stored conversation of `previous_response_id` (if any),
then this request's input, with `instructions` as a leading system message of this
request only (OpenAI does not carry instructions over to the next response). A function
call becomes the assistant's `tool_calls` (joined to the assistant message before it),
its output a `tool` message, as chat completions send them.

`tools` are the Responses API's flat functions (`{"type": "function", "name", ...}`,
where chat nests them under `function`); served as chat's are (server/tools.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from sparsevllm.sampling import SamplingParams
from sparsevllm.server.errors import APIError, bad_request, from_value_error
from sparsevllm.server.protocol import (
    MAX_TOOLS,
    FunctionName,
    SparseFields,
    StrictModel,
    engine_temperature,
    template_message,
)
from sparsevllm.server.structured import (
    JsonSchemaFormat,
    ResponseFormat,
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


class FunctionCallItem(StrictModel):
    """An earlier reply's function call, sent back (as the output item, or made up)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object's text
    id: str | None = None  # echoed output items carry theirs; ignored
    status: str | None = None


class FunctionCallOutput(StrictModel):
    """What the client's function returned for `call_id`: a `tool` message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else [p.text for p in self.output]
        return {**template_message("tool", text), "tool_call_id": self.call_id}


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput


def history_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat-template messages: function calls join the assistant message
    they follow (or start one), as a chat reply that calls tools is one message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, FunctionCallItem):
            out.append(item.as_template_input())
            continue
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        call = template_tool_calls([(item.call_id, item.name, item.arguments)])
        out[-1]["tool_calls"] = [*out[-1].get("tool_calls", []), *call]
    return out


class FunctionTool(StrictModel):
    """One entry of `tools`: a function the model may call (flat, unlike chat's)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        return _not_nested(data, "tools")

    def as_function(self) -> Function:
        return Function(self.name, self.description, self.parameters, self.strict)


class FunctionChoice(StrictModel):
    """`tool_choice` naming one function: `{"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str


def _not_nested(data: Any, field: str) -> Any:
    """Chat completions' shape, sent here, fails with the shape this API wants."""
    if isinstance(data, dict) and "function" in data:
        raise ValueError(
            f'{field}: the Responses API names functions flat, {{"type": "function", '
            f'"name": ...}}, not nested under "function" as chat completions does'
        )
    return data


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


class ResponsesRequest(SparseFields):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
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
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None  # accepted and ignored
    # vLLM's extras: greedy decoding checks and reproducible samples.
    seed: int | None = None
    top_k: int | None = Field(None, ge=-1)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _flat_choice(cls, value: Any) -> Any:
        return _not_nested(value, "tool_choice")

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
        names = [t.name for t in self.tools or []]
        check_tool_choice(names, tool_choice_kind(self.tool_choice), self._named())
        return self

    def _named(self) -> str | None:
        choice = self.tool_choice
        return choice.name if isinstance(choice, FunctionChoice) else None

    def tool_request(self) -> ToolRequest | None:
        """The tools and tool choice (server/tools.py); None without tools."""
        if not self.tools:
            return None
        return ToolRequest(
            tuple(t.as_function() for t in self.tools),
            tool_choice_kind(self.tool_choice),
            self._named(),
            constrained=self.structured().params is not None,
        )

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat-template messages (no instructions)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return history_messages(self.input)

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
            **self.sparse_values(),
        }
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None})
        except ValueError as e:
            raise from_value_error(e) from None
