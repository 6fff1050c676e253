"""Tool-call parsers and the streamed content around calls."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from sparsevllm.server.tool_parsers import PARSERS, parse_hermes, parse_llama3_json
from sparsevllm.server.tools import ToolPlan, ToolStream

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_calls_and_the_content_before_them() -> None:
    text = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{CALL}</tool_call>"
    parsed = parse_hermes(text)
    assert parsed.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    assert len({c.id for c in parsed.calls}) == 2
    assert parse_hermes(f"<tool_call>{CALL}</tool_call>").content is None


def test_malformed_calls_stay_content() -> None:
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "plain answer",
    ):
        parsed = parse_hermes(text)
        assert (parsed.content, parsed.calls) == (text, []), text


def test_llama3_json_calls() -> None:
    one = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}'
    assert [(c.name, c.arguments) for c in parse_llama3_json(one).calls] == [("f", '{"x": 1}')]
    two = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"y": "z"}}'
    parsed = parse_llama3_json(two)
    assert parsed.content is None and [c.name for c in parsed.calls] == ["f", "g"]
    assert parse_llama3_json('{"name": "f", "parameters": {}} trailing').calls == []
    assert parse_llama3_json("The answer is 4.").content == "The answer is 4."


@given(
    head=st.sampled_from(["", "Sure. ", "a <tool", "x\n"]),
    calls=st.integers(0, 2),
    cuts=st.lists(st.integers(0, 200), max_size=10),
)
def test_a_stream_sends_what_the_whole_reply_says(head: str, calls: int, cuts: list[int]):
    text = head + "".join(f"<tool_call>{CALL}</tool_call>" for _ in range(calls))
    plan = ToolPlan([], PARSERS["hermes"], None)
    stream, sent, got = ToolStream(plan), 0, None
    content = ""
    for end in sorted({min(c, len(text)) for c in cuts} | {len(text)}):
        piece, deltas = stream.feed(text[sent:end], finished=end == len(text))
        sent = end
        content += piece
        got = deltas or got
    whole = parse_hermes(text)
    assert content == (whole.content or "" if whole.calls else text)
    assert [d["function"]["name"] for d in got or []] == [c.name for c in whole.calls]
    assert [d["index"] for d in got or []] == list(range(len(whole.calls)))
