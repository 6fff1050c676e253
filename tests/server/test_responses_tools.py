"""Tool calls on /v1/responses with the official client, on the scripted tiny model whose
greedy reply spells a hermes call (tool_model.py): `function_call` output items, the
round trip with `function_call_output` (through previous_response_id and sent whole),
the streamed events, and malformed tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config
from .tool_model import ASK, TOOLS, scripted_tool_model

# The Responses API's tools are flat: the chat tools' `function` fields, beside `type`.
FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def server(tiny_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = scripted_tool_model(tiny_path, tmp_path_factory.mktemp("calling"))
    running = start_server(
        tiny_config(model), served_model_name=TINY_NAME, tool_call_parser="hermes"
    )
    yield running
    running.stop()


def create(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().responses.create(model=TINY_NAME, **{**GREEDY, **kwargs})


def calls_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


def test_a_call_is_a_function_call_item(server: RunningServer) -> None:
    plain = create(server, input=ASK[0]["content"])
    called = create(server, input=ASK[0]["content"], tools=FLAT_TOOLS)
    # The template rendered the tools: "<s> system : w77 </s>" is 5 more input tokens.
    assert called.usage.input_tokens == plain.usage.input_tokens + 5
    assert [item.type for item in plain.output] == ["message"]
    calls = calls_of(called)  # the reply may spell the call more than once
    assert calls and [item.type for item in called.output] == ["function_call"] * len(calls)
    for call in calls:
        assert call.name == "w77" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert call.status == "completed"
    assert len({c.call_id for c in calls}) == len(calls)
    assert called.status == "completed" and called.output_text == ""
    assert [t.name for t in called.tools] == ["w77"] and called.tool_choice == "auto"
    # The stored body is the one returned.
    stored = server.client().responses.retrieve(called.id)
    assert [c.call_id for c in calls_of(stored)] == [c.call_id for c in calls]


def test_the_function_call_output_round_trips(server: RunningServer) -> None:
    first = create(server, input=ASK[0]["content"], tools=FLAT_TOOLS)
    call = calls_of(first)[0]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "w9 w10"}
    after = create(
        server, previous_response_id=first.id, input=[answer], tools=FLAT_TOOLS, tool_choice="none"
    )
    assert [item.type for item in after.output] == ["message"] and after.tool_choice == "none"
    # The same conversation sent whole, the call items echoed back: the same prompt.
    whole = create(
        server, input=[*ASK, *first.output, answer], tools=FLAT_TOOLS, tool_choice="none"
    )
    assert whole.usage.input_tokens == after.usage.input_tokens
    assert whole.output_text == after.output_text
    # And the prompt chat completions renders for the call and its tool message.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls_of(first)]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "w9 w10"},
    ]  # fmt: skip
    chat = server.client().chat.completions.create(
        model=TINY_NAME, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert chat.usage.prompt_tokens == after.usage.input_tokens


def test_streamed_calls(server: RunningServer) -> None:
    events = list(create(server, input=ASK[0]["content"], tools=FLAT_TOOLS, stream=True))
    kinds = [e.type for e in events]
    final = events[-1].response
    calls = calls_of(final)
    per_call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert kinds == ["response.created", "response.in_progress", *per_call * len(calls),
                     "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in added] == ["in_progress"] * len(calls)
    assert [e.item.arguments for e in added] == [""] * len(calls)
    assert [e.item.model_dump() for e in done] == [c.model_dump() for c in calls]
    assert [e.output_index for e in done] == list(range(len(calls)))
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [(e.item_id, e.delta) for e in deltas] == [(c.id, c.arguments) for c in calls]
    assert len(calls) == len(calls_of(create(server, input=ASK[0]["content"], tools=FLAT_TOOLS)))


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"tools": TOOLS}, "tools.0", "names functions flat"),  # chat's nested shape
        ({"tools": [{"type": "function"}]}, "tools.0.name", "name"),
        ({"tools": [{"type": "browser", "name": "b"}]}, "tools.0.type", "function"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0.name", "pattern"),
        ({"tools": FLAT_TOOLS * 2}, "", "names must be unique"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "x"}}, "", "'x'"),
        ({"tool_choice": "required"}, "", "needs tools"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice",
         "names functions flat"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", ""),
        ({"tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
         "tool_choice", "drop the output constraint"),
    ],
)  # fmt: skip
def test_malformed_tools_are_400(
    server: RunningServer, extra: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": TINY_NAME, "input": "w1", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    assert message in error["message"]
    assert create(server, input="w3").status in ("completed", "incomplete")


def test_auto_without_a_parser_says_how_to_start_the_server(tiny_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as e:
        tiny_server.client().responses.create(
            model=TINY_NAME, input="w1", max_output_tokens=4, tools=FLAT_TOOLS
        )
    assert e.value.body["param"] == "tools"
