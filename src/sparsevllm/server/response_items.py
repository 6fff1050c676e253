"""Output items of a response: an optional `reasoning` item (with a reasoning parser),
the assistant `message` (left out when the reply is only function calls), then one
`function_call` item per call; and the count of reasoning tokens for the usage."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.server.reasoning import CLOSE, ReasoningParser
from sparsevllm.server.tool_parsers import ToolCall
from sparsevllm.server.tools import ToolPlan, split_calls, template_tool_calls


@dataclass
class ItemIds:
    """The ids of a response's items, fixed once so stream events and body agree."""

    reasoning: str = field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    message: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")


def message_item(item_id: str, text: str | None) -> dict[str, Any]:
    """The assistant message; `text` None: in progress (no content part yet)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": "in_progress" if text is None else "completed",
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    """The reasoning item; `text` None: in progress."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {
        "type": "reasoning",
        "id": item_id,
        "status": "in_progress" if text is None else "completed",
        "summary": [],
        "content": content,
    }


def function_call_item(call: ToolCall) -> dict[str, Any]:
    """A call of the reply: `call_id` is what the client's function_call_output answers;
    the item's own id is derived from it, so every body built from the reply agrees."""
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


@dataclass(frozen=True)
class Reply:
    """A finished reply split into its parts (parsed once: calls get fresh ids)."""

    reasoning: str | None
    content: str | None  # None: the reply is only calls
    calls: list[ToolCall]

    def history(self) -> dict[str, Any]:
        """The assistant message a later turn's template sees: the answer and its calls,
        not the reasoning (chat templates drop earlier turns' reasoning too)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.calls:
            message["tool_calls"] = template_tool_calls(
                [(c.id, c.name, c.arguments) for c in self.calls]
            )
        return message


def split_reply(text: str, parser: ReasoningParser | None, plan: ToolPlan) -> Reply:
    reasoning, answer = None, text
    if parser is not None:
        split = parser.split(text, finished=True)
        reasoning, answer = split.reasoning, split.content
    parsed = split_calls(answer, plan)
    return Reply(reasoning, parsed.content, parsed.calls)


def output_items(ids: ItemIds, reply: Reply) -> list[dict[str, Any]]:
    """The final output of a reply."""
    # An empty block ("</think>" first) gives no item, as a stream opens none for it.
    items = [reasoning_item(ids.reasoning, reply.reasoning)] if reply.reasoning else []
    if not reply.calls or reply.content:
        items.append(message_item(ids.message, reply.content or ""))
    return [*items, *map(function_call_item, reply.calls)]


def reasoning_tokens(tokenizer: Any, output_ids: list[int], has_reasoning: bool) -> int:
    """Generated tokens up to the one that completes `</think>` (all of them when the
    block never closes): the shortest prefix whose text holds the tag, by bisection."""
    if not has_reasoning or tokenizer is None:
        return 0

    def closes(n: int) -> bool:
        return CLOSE in tokenizer.decode(output_ids[:n], skip_special_tokens=False)

    if not closes(len(output_ids)):
        return len(output_ids)
    lo, hi = 1, len(output_ids)  # closes(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if closes(mid) else (mid + 1, hi)
    return lo
