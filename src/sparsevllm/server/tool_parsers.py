"""Tool-call parsers: the function calls a reply makes, in the model family's format.

`sparsevllm serve --tool-call-parser NAME`:

- `hermes` (Hermes, Qwen2.5/Qwen3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text before the first call is the reply's content;
- `llama3_json` (Llama 3.1-3.3): the whole reply is one JSON object `{"name": ...,
  "parameters": {...}}` (or several separated by `;`), optionally after `<|python_tag|>`.

A block that is not valid JSON, or lacks a name, is left as content: a reply is only
turned into calls when every call in it parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.engine.detokenizer import releasable_prefix

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Parsed:
    content: str | None  # None: the reply is only calls
    calls: list[ToolCall]


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> Parsed:
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return Parsed(text, [])
    calls = []
    for block in blocks:
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            call = None
        if call is None:
            return Parsed(text, [])
        calls.append(call)
    # Not stripped: a stream has sent this text as it came.
    content = text[: text.index(HERMES_OPEN)]
    return Parsed(content if content.strip() else None, calls)


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return Parsed(text, [])
        call = _call(obj, "parameters")
        if call is None:
            return Parsed(text, [])
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return Parsed(None, calls)


@dataclass(frozen=True)
class ToolParser:
    name: str
    # Where calls begin: a stream holds content back from here on (None: from the
    # first character that may start a JSON object).
    marker: str | None

    def parse(self, text: str) -> Parsed:
        return parse_hermes(text) if self.name == "hermes" else parse_llama3_json(text)

    def releasable(self, text: str) -> int:
        """How much of a running reply's text is content for sure (sent while it runs)."""
        if self.marker is None:
            head = text.lstrip()
            return 0 if not head or head[0] in "{<" else len(text)
        at = text.find(self.marker)
        return at if at >= 0 else releasable_prefix(text, [self.marker])


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", HERMES_OPEN),
    "llama3_json": ToolParser("llama3_json", None),
}


def get_tool_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (available: {', '.join(PARSERS)})")
    return PARSERS[name]
