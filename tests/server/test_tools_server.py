"""Tool calls over HTTP with the official client: `tool_choice` auto through
`--tool-call-parser hermes` on a scripted tiny model (its tokenizer spells the greedy
reply as a call), tools rendered by the template, the call sent back in the history,
streaming, and bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config
from .tool_model import ASK, TOOLS, scripted_tool_model


@pytest.fixture(scope="module")
def calling_model(tiny_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return scripted_tool_model(tiny_path, tmp_path_factory.mktemp("calling"))


@pytest.fixture(scope="module")
def server(calling_model: str) -> Iterator[RunningServer]:
    running = start_server(
        tiny_config(calling_model), served_model_name=TINY_NAME, tool_call_parser="hermes"
    )
    yield running
    running.stop()


def chat(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=TINY_NAME, temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True}, **kwargs
    )


def test_a_call_round_trips(server: RunningServer) -> None:
    plain = chat(server, messages=ASK)
    called = chat(server, messages=ASK, tools=TOOLS)
    # The template rendered the tools: "<s> system : w77 </s>" is 5 more prompt tokens.
    assert called.usage.prompt_tokens == plain.usage.prompt_tokens + 5
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls  # the reply may spell the call more than once
    assert calls and all(c.type == "function" and c.function.name == "w77" for c in calls)
    assert all(json.loads(c.function.arguments) == {"city": "Paris"} for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "w9 w10"},
    ]
    after = chat(server, messages=history, tools=TOOLS, tool_choice="none")
    assert after.choices[0].message.tool_calls is None
    assert after.usage.prompt_tokens > called.usage.prompt_tokens


def test_streamed_calls(server: RunningServer) -> None:
    chunks = list(chat(server, messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    whole = chat(server, messages=ASK, tools=TOOLS).choices[0].message.tool_calls
    assert [(tc.index, tc.function.name) for tc in calls] == [(i, "w77") for i in range(len(whole))]
    assert [tc.function.arguments for tc in calls] == [c.function.arguments for c in whole]
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "browser"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, ""),
        ({"tool_choice": "required"}, ""),
        ({"tools": TOOLS + TOOLS}, ""),
    ],
)
def test_malformed_tools_are_400(server: RunningServer, extra: dict[str, Any], param: str) -> None:
    body = {"model": TINY_NAME, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "")
    assert chat(server, messages=ASK).choices[0].finish_reason == "length"


def test_auto_without_a_parser_says_how_to_start_the_server(tiny_server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser") as e:
        tiny_server.client().chat.completions.create(
            model=TINY_NAME, messages=ASK, max_tokens=4, tools=TOOLS
        )
    assert e.value.body["param"] == "tools"
