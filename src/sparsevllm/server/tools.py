"""Tool calling in chat completions: what a request's `tools` and `tool_choice` mean for
its prompt, its sampling and its reply.

- The chat template renders `tools` (a template without tool support ignores them).
- `tool_choice` `auto` (the default with tools): the reply is parsed by the server's
  `--tool-call-parser` (server/tool_parsers.py); without one, tools are refused.
- `required` or a named function: the reply is constrained (structured outputs) to one
  JSON object `{"name": ..., "arguments": {...}}` of an offered function, whose
  arguments follow its `parameters` schema; no parser is needed.
- `none`: the tools are rendered, the reply is plain content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsevllm.server.errors import bad_request
from sparsevllm.server.protocol import ChatCompletionRequest, NamedToolChoice
from sparsevllm.server.tool_parsers import Parsed, ToolCall, ToolParser, parse_llama3_json
from sparsevllm.structured_outputs import StructuredOutputsParams


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


def plan_tools(req: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    if not req.tools:
        return ToolPlan(None, None, None)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice or "auto"
    if choice == "none":
        return ToolPlan(tools, None, None)
    if choice == "auto":
        if parser is None:
            raise bad_request(
                "this server parses no tool calls: start it with --tool-call-parser "
                "(hermes or llama3_json), or send tool_choice 'required' or a named function",
                param="tools",
            )
        return ToolPlan(tools, parser, None)
    if req.structured().params is not None:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the reply already; "
            "drop the output constraint",
            param="tool_choice",
        )
    names = [choice.function.name] if isinstance(choice, NamedToolChoice) else None
    schema = _call_schema(req, names)
    return ToolPlan(tools, None, StructuredOutputsParams(json=schema), constrained=True)


def _call_schema(req: ChatCompletionRequest, names: list[str] | None) -> dict[str, Any]:
    """One call object of the named (or any offered) function."""
    options = []
    for tool in req.tools or []:
        fn = tool.function
        if names is not None and fn.name not in names:
            continue
        params = fn.parameters or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_message(text: str, plan: ToolPlan) -> tuple[dict[str, Any], bool]:
    """The assistant message of a finished reply and whether it calls tools."""
    if not plan.parses:
        return {"role": "assistant", "content": text}, False
    parsed = plan.parse(text)
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
