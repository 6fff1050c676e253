"""The event stream of a `stream: true` response (the Responses API's named SSE events).

Order: `response.created`, `response.in_progress`; per output item (a reasoning item
first when the reply thinks, then the message) `response.output_item.added`,
`response.content_part.added`, its text deltas (`response.reasoning_text.delta` or
`response.output_text.delta`), `...text.done`, `response.content_part.done`,
`response.output_item.done`; then per function call (they come whole, once the reply
has ended: a partial call does not parse) `response.output_item.added`,
`response.function_call_arguments.delta` and `.done`, `response.output_item.done`;
finally `response.completed` (or `response.incomplete`) with the same body a
non-streamed request returns. Every event has a `sequence_number`.

With tools, message text is sent while it surely precedes any call (tools.ToolStream),
so a reply that turns out to be only calls opens no message item, as its body has none.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from sparsevllm.server.formatting import Choice
from sparsevllm.server.reasoning import ReasoningParser, ReasoningStream
from sparsevllm.server.response_items import ItemIds, message_item, reasoning_item
from sparsevllm.server.tools import ToolPlan, ToolStream

_PARTS = {"reasoning": "reasoning_text", "message": "output_text"}


class Turn(Protocol):
    """What the stream needs of the response it streams (responses._Turn)."""

    choice: Choice
    ids: ItemIds
    plan: ToolPlan

    def body(self, final: Any) -> dict[str, Any]: ...
    def finish(self) -> dict[str, Any]: ...


class _Writer:
    """Numbers the events, tracks the output item being written and its text so far."""

    def __init__(self, ids: ItemIds) -> None:
        self.ids = ids
        self.numbers = itertools.count()
        self.index = -1
        self.open: str | None = None  # "reasoning" or "message"
        self.text = {"reasoning": "", "message": ""}

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": next(self.numbers), **data}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _where(self, kind: str) -> dict[str, Any]:
        item_id = self.ids.reasoning if kind == "reasoning" else self.ids.message
        return {"item_id": item_id, "output_index": self.index, "content_index": 0}

    def _part(self, kind: str) -> dict[str, Any]:
        part = {"type": _PARTS[kind], "text": self.text[kind]}
        return {**part, "annotations": []} if kind == "message" else part

    def _item(self, kind: str, done: bool) -> dict[str, Any]:
        make = reasoning_item if kind == "reasoning" else message_item
        return make(self._where(kind)["item_id"], self.text[kind] if done else None)

    def start(self, kind: str) -> list[str]:
        """Events that finish the open item if it is the reasoning and `kind` is the
        message (its text is final then), and open `kind` unless it is open."""
        if self.open == kind:
            return []
        events = self.done(self.open) if self.open is not None else []
        self.index += 1
        self.open = kind
        added = {"output_index": self.index, "item": self._item(kind, done=False)}
        return [
            *events,
            self.event("response.output_item.added", **added),
            self.event("response.content_part.added", **self._where(kind), part=self._part(kind)),
        ]

    def delta(self, kind: str, piece: str) -> list[str]:
        events = self.start(kind)
        self.text[kind] += piece
        extra = {"logprobs": []} if kind == "message" else {}
        name = f"response.{_PARTS[kind]}.delta"
        return [*events, self.event(name, **self._where(kind), delta=piece, **extra)]

    def done(self, kind: str) -> list[str]:
        extra = {"logprobs": []} if kind == "message" else {}
        where = self._where(kind)
        return [
            self.event(f"response.{_PARTS[kind]}.done", **where, text=self.text[kind], **extra),
            self.event("response.content_part.done", **where, part=self._part(kind)),
            self.event(
                "response.output_item.done", output_index=self.index, item=self._item(kind, True)
            ),
        ]

    def close(self, output: list[dict[str, Any]]) -> list[str]:
        """Events that end the open items as the final `output` has them (a reply of
        reasoning only still has its empty message), then the function calls'."""
        kinds = [item["type"] for item in output]
        if "message" in kinds:
            events = [*self.start("message"), *self.done("message")]
        else:
            events = self.done(self.open) if self.open is not None else []
        for item in output:
            if item["type"] == "function_call":
                events += self.call(item)
        return events

    def call(self, item: dict[str, Any]) -> list[str]:
        self.index += 1
        self.open = None
        where = {"item_id": item["id"], "output_index": self.index}
        added = {**item, "arguments": "", "status": "in_progress"}
        args = item["arguments"]
        return [
            self.event("response.output_item.added", output_index=self.index, item=added),
            self.event("response.function_call_arguments.delta", **where, delta=args),
            self.event("response.function_call_arguments.done", **where, arguments=args),
            self.event("response.output_item.done", output_index=self.index, item=item),
        ]


async def response_events(
    turn: Turn, stream: Any, parser: ReasoningParser | None
) -> AsyncIterator[str]:
    """The SSE events of `turn` as its engine request runs; aborts it however it ends."""
    w = _Writer(turn.ids)
    split = ReasoningStream(parser) if parser is not None else None
    tools = ToolStream(turn.plan) if turn.plan.parses else None
    choice = turn.choice
    try:
        yield w.event("response.created", response=turn.body(None))
        yield w.event("response.in_progress", response=turn.body(None))
        while not stream.done:
            out = await stream.next()
            if out.request_id != choice.request_id:
                continue
            if out.finish_reason == "error":
                message = out.error or "the engine failed"
                yield w.event("error", code="server_error", message=message, param=None)
                return
            if out.finished:
                choice.final = out
            text = choice.text_delta(out)
            reasoning, content = (
                ("", text)
                if split is None
                else split.deltas(out.text[: choice.sent_chars], out.finished)
            )
            if tools is not None:  # calls come whole with the body, below
                content, _ = tools.feed(content, out.finished)
            for kind, piece in (("reasoning", reasoning), ("message", content)):
                for event in w.delta(kind, piece) if piece else []:
                    yield event
        body = turn.finish()
        for event in w.close(body["output"]):
            yield event
        done = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield w.event(done, response=body)
    finally:
        stream.abort()  # no-op once the request finished
