"""Structured outputs in the API: OpenAI's `response_format` and vLLM's
`structured_outputs` (and its older `guided_*` fields), turned into the engine's
StructuredOutputsParams.

A request names its constraint in one of three ways, and only one per request:
`response_format` (`{"type": "json_object"}`, or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`), `structured_outputs` (vLLM's current
object: `json`, `regex`, `choice`, `grammar`, `json_object`, `disable_any_whitespace`,
`whitespace_pattern`)
or the `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields vLLM
accepted before it. The field used is the `param` of any error about the constraint,
including the engine's when it cannot compile it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sparsevllm.server.errors import bad_request
from sparsevllm.structured_outputs import StructuredOutputsParams

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# OpenAI's limit on a json_schema's name.
MAX_SCHEMA_NAME_LEN = 64


class _Strict(BaseModel):
    # The request bodies' rules (protocol.StrictModel), restated: that module imports this.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema (any JSON object when absent). `strict`
    is accepted for OpenAI clients; the constraint is always enforced exactly."""

    name: str = Field(min_length=1, max_length=MAX_SCHEMA_NAME_LEN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: `text` (no constraint), `json_object`, `json_schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format: json_schema is required with type 'json_schema' and "
                "allowed only with it"
            )
        return self


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` object (StructuredOutputsParams' fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


@dataclass(frozen=True)
class StructuredRequest:
    """A request's constraint (None: unconstrained) and the field it came from."""

    params: StructuredOutputsParams | None = None
    param: str | None = None


def resolve_structured(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsBody | None,
    guided: dict[str, Any],
) -> StructuredRequest:
    """The request's constraint; a 400 naming the field when it is malformed or when
    more than one field gives a constraint."""
    given = {name: value for name, value in guided.items() if value is not None}
    sources = list(given)
    if structured_outputs is not None:
        sources.append("structured_outputs")
    if response_format is not None and response_format.type != "text":
        sources.append("response_format")
    if not sources:
        return StructuredRequest()
    if len(sources) > 1:
        raise bad_request(
            f"give the output constraint in one field only, not in {', '.join(sources)}",
            param=sources[0],
        )
    param = sources[0]
    try:
        if response_format is not None and param == "response_format":
            spec = _from_response_format(response_format)
        elif structured_outputs is not None:
            spec = _from_body(structured_outputs)
        else:
            spec = StructuredOutputsParams(
                json=given.get("guided_json"),
                regex=given.get("guided_regex"),
                choice=given.get("guided_choice"),
                grammar=given.get("guided_grammar"),
            )
    except ValueError as e:  # StructuredOutputsParams' messages name its own fields
        message = str(e) if param == "structured_outputs" else f"{param}: {e}"
        raise bad_request(message, param=param) from None
    return StructuredRequest(spec, param)


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:  # json_object, or a json_schema without a schema
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=schema)


def _from_body(body: StructuredOutputsBody) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        json=body.json_,
        regex=body.regex,
        choice=body.choice,
        grammar=body.grammar,
        json_object=bool(body.json_object),
        disable_any_whitespace=bool(body.disable_any_whitespace),
        whitespace_pattern=body.whitespace_pattern,
    )
