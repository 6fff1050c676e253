"""Output items of a response: an optional `reasoning` item (with a reasoning parser),
then the assistant `message`; and the count of reasoning tokens for the usage."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sparsevllm.server.reasoning import CLOSE, ReasoningParser


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


def output_items(ids: ItemIds, text: str, parser: ReasoningParser | None) -> list[dict[str, Any]]:
    """The final output of a reply's text."""
    if parser is None:
        return [message_item(ids.message, text)]
    split = parser.split(text, finished=True)
    # An empty block ("</think>" first) gives no item, as a stream opens none for it.
    items = [reasoning_item(ids.reasoning, split.reasoning)] if split.reasoning else []
    return [*items, message_item(ids.message, split.content)]


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
