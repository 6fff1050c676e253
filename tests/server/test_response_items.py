"""A response's output items and streamed events for replies that think, say something
and call functions: the stream's items are the body's, its message text is the body's
content (never the call's text), and a reply of calls only opens no message."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sparsevllm.outputs import RequestOutput
from sparsevllm.server.formatting import Choice
from sparsevllm.server.reasoning import get_reasoning_parser
from sparsevllm.server.response_events import response_events
from sparsevllm.server.response_items import ItemIds, Reply, output_items, split_reply
from sparsevllm.server.tool_parsers import PARSERS
from sparsevllm.server.tools import ToolPlan

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
HERMES = ToolPlan(
    [{"type": "function", "function": {"name": "get_weather"}}], PARSERS["hermes"], None
)


class FakeStream:
    """The engine's outputs of one request, as `ctx.submit` hands them out."""

    def __init__(self, pieces: list[str]) -> None:
        texts = ["".join(pieces[: i + 1]) for i in range(len(pieces))]
        self.outputs = [
            RequestOutput.single("r", None, [1], text, list(range(i + 1)), i == len(texts) - 1,
                                 "stop" if i == len(texts) - 1 else None)
            for i, text in enumerate(texts)
        ]  # fmt: skip
        self.aborted = False

    @property
    def done(self) -> bool:
        return not self.outputs

    async def next(self) -> RequestOutput:
        return self.outputs.pop(0)

    def abort(self) -> None:
        self.aborted = True


class FakeTurn:
    """What response_events needs of responses._Turn: the body of the split reply."""

    def __init__(self, parser: Any, plan: ToolPlan) -> None:
        self.choice = Choice(0, 0, "r")
        self.ids, self.plan, self.parser = ItemIds(), plan, parser
        self.reply: Reply | None = None

    def body(self, final: RequestOutput | None) -> dict[str, Any]:
        if final is not None and self.reply is None:
            self.reply = split_reply(final.text, self.parser, self.plan)
        output = [] if self.reply is None else output_items(self.ids, self.reply)
        return {"status": "completed", "output": output}

    def finish(self) -> dict[str, Any]:
        return self.body(self.choice.final)


def stream_events(pieces: list[str], reasoning: str | None) -> list[dict[str, Any]]:
    parser = get_reasoning_parser(reasoning) if reasoning else None
    turn = FakeTurn(parser, HERMES)

    async def run() -> list[str]:
        return [e async for e in response_events(turn, FakeStream(pieces), parser)]

    return [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]


@pytest.mark.parametrize(
    "pieces, reasoning, items, text",
    [
        (["<think>hmm", "</think>\n\nLet me ", "check. <tool_", CALL[6:]], "qwen3",
         ["reasoning", "message", "function_call"], "Let me check. "),
        (["<think>hmm</think>\n\n", CALL[:20], CALL[20:]], "qwen3", ["reasoning", "function_call"], None),
        ([CALL[:5], CALL[5:], CALL], None, ["function_call", "function_call"], None),
        (["Paris is ", "sunny."], None, ["message"], "Paris is sunny."),
    ],
)  # fmt: skip
def test_streamed_items_are_the_body_items(pieces, reasoning, items, text) -> None:
    events = stream_events(pieces, reasoning)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in final["output"]] == items
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == final["output"]
    assert [e["output_index"] for e in done] == list(range(len(items)))
    sent = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert sent == (text or "")
    message = [item for item in final["output"] if item["type"] == "message"]
    assert [m["content"][0]["text"] for m in message] == ([text] if text is not None else [])
    for call in (item for item in final["output"] if item["type"] == "function_call"):
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
        assert call["id"] == "fc_" + call["call_id"].removeprefix("call_")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_history_keeps_the_answer_and_its_calls_not_the_reasoning() -> None:
    reply = split_reply(
        f"<think>hmm</think>\n\nLet me check. {CALL}", get_reasoning_parser("qwen3"), HERMES
    )
    history = reply.history()
    assert history["role"] == "assistant" and history["content"] == "Let me check. "
    [call] = history["tool_calls"]
    assert call["id"] == reply.calls[0].id
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    plain = split_reply("no calls here", None, ToolPlan(None, None, None)).history()
    assert plain == {"role": "assistant", "content": "no calls here"}
