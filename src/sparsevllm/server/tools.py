"""Tool calling, for chat completions and responses alike: what a request's tools and
`tool_choice` mean for its prompt, its sampling and its reply.

- The chat template renders the tools (a template without tool support ignores them),
  in Hugging Face's shape `{"type": "function", "function": {...}}` whichever API sent
  them (chat nests the function, the Responses API does not).
- `tool_choice` `auto` (the default with tools): the reply is parsed by the server's
  `--tool-call-parser` (server/tool_parsers.py); without one, tools are refused.
- `required` or a named function: the reply is constrained (structured outputs) to one
  JSON object `{"name": ..., "arguments": {...}}` of an offered function, whose
  arguments follow its `parameters` schema; no parser is needed.
- `none`: the tools are rendered, the reply is plain content.

Each API turns its own request shape into a `ToolRequest` (protocol.py,
responses_protocol.py) and its own reply shape out of the `Parsed` calls.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparsevllm.sampling import SamplingParams
from sparsevllm.server.errors import bad_request
from sparsevllm.server.tool_parsers import Parsed, ToolCall, ToolParser, parse_llama3_json
from sparsevllm.structured_outputs import StructuredOutputsParams


@dataclass(frozen=True)
class Function:
    """A function the model may call, as either API describes it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        fields = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        return {"type": "function", "function": {k: v for k, v in fields.items() if v is not None}}


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools and tool choice, whichever API they came in."""

    functions: tuple[Function, ...]
    choice: str = "auto"  # auto | none | required | function (the one named)
    name: str | None = None  # the named function
    constrained: bool = False  # the request constrains its output already


def tool_choice_kind(choice: object) -> str:
    """A request's `tool_choice` as ToolRequest.choice: its string, "auto" when unset,
    "function" for a named function (an object in both APIs)."""
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else "function"


def check_tool_choice(names: Sequence[str], choice: str | None, named: str | None) -> None:
    """ValueError (a 400) for duplicate function names, or a choice the tools cannot meet."""
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if choice not in (None, "none", "auto") and not names:
        raise ValueError("tool_choice other than none/auto needs tools")
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names {named!r}, which is not in tools ({', '.join(names)})")


def template_tool_calls(calls: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """(id, name, arguments text) of earlier calls as chat templates read them: HF's shape,
    the arguments as a mapping."""
    return [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": _parsed(args)}}
        for call_id, name, args in calls
    ]


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are served."""

    tools: list[dict[str, Any]] | None  # for the chat template (None: no tools)
    parser: ToolParser | None  # parses `auto` replies
    constraint: StructuredOutputsParams | None  # `required` / named
    constrained: bool = False

    @property
    def parses(self) -> bool:
        return self.parser is not None or self.constrained

    def parse(self, text: str) -> Parsed:
        if self.constrained:  # the grammar wrote exactly one call object
            return parse_llama3_json(text)
        assert self.parser is not None
        return self.parser.parse(text)

    def constrain(
        self, params: SamplingParams, param: str | None
    ) -> tuple[SamplingParams, str | None]:
        """A request's sampling with the call constraint of `required` / a named function
        (its errors then name `tool_choice`), else as it was."""
        if self.constraint is None:
            return params, param
        return dataclasses.replace(params, structured_outputs=self.constraint), "tool_choice"


def plan_tools(request: ToolRequest | None, parser: ToolParser | None) -> ToolPlan:
    if request is None or not request.functions:
        return ToolPlan(None, None, None)
    tools = [f.for_template() for f in request.functions]
    if request.choice == "none":
        return ToolPlan(tools, None, None)
    if request.choice == "auto":
        if parser is None:
            raise bad_request(
                "this server parses no tool calls: start it with --tool-call-parser "
                "(hermes or llama3_json), or send tool_choice 'required' or a named function",
                param="tools",
            )
        return ToolPlan(tools, parser, None)
    if request.constrained:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the reply already; "
            "drop the output constraint",
            param="tool_choice",
        )
    offered = [f for f in request.functions if request.name in (None, f.name)]
    schema = _call_schema(offered)
    return ToolPlan(tools, None, StructuredOutputsParams(json=schema), constrained=True)


def _call_schema(functions: Sequence[Function]) -> dict[str, Any]:
    """One call object of one of `functions`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": f.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def split_calls(text: str, plan: ToolPlan) -> Parsed:
    """A finished reply's content and calls (no calls when the plan parses none)."""
    return plan.parse(text) if plan.parses else Parsed(text, [])


def tool_message(text: str, plan: ToolPlan) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished chat reply and whether it calls tools."""
    parsed = split_calls(text, plan)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [c.as_openai() for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True


def stream_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Tool-call deltas of a finished reply: one per call, whole (index, id, name and
    the arguments' full text)."""
    return [c.as_openai(index=i) for i, c in enumerate(calls)]


@dataclass
class ToolStream:
    """A streamed reply's content with tool calls held back: content is sent while it
    surely precedes any call; at the end the calls go out whole, or the held text as
    content if the reply calls nothing."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0

    def feed(self, piece: str, finished: bool) -> tuple[str, list[dict[str, Any]] | None]:
        """(content to send now, tool-call deltas once the reply made calls)."""
        self.text += piece
        if not finished:
            parser = self.plan.parser
            end = 0 if parser is None else parser.releasable(self.text)
            if not self.text[:end].strip():
                end = 0  # whitespace before a call is no content (the body says null)
            return self._send(max(end, self.sent)), None
        parsed = self.plan.parse(self.text)
        if not parsed.calls:
            return self._send(len(self.text)), None
        return self._send(max(len(parsed.content or ""), self.sent)), stream_calls(parsed.calls)

    def _send(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = end
        return out
