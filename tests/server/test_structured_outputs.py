"""Structured outputs through the official `openai` client, on the bundled default model
(SmolLM2-135M-Instruct): `response_format` (json_schema, json_object), vLLM's
`structured_outputs` and `guided_*` fields (regex, choice, grammar), on both endpoints,
streamed and not; a constraint the grammar library rejects is a 400 in OpenAI's shape
and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sparsevllm.config import EngineConfig
from sparsevllm.models.default_model import default_model_path
from structured_helpers import PERSON, person_problem

from .conftest import RunningServer, python_example, start_server

ASK = [{"role": "user", "content": "Describe a user of a web site as JSON."}]
PERSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
NUM_JSON_COMPLETIONS = 100
REGEX = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
DATE = r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"
COLORS = ["red", "green", "blue", "light yellow"]
GRAMMAR = 'start: "sum(" num ", " num ")"\nnum: /[1-9][0-9]?/'


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # Room for the 100 concurrent requests in one running batch.
    running = start_server(EngineConfig(max_num_seqs=128, max_model_len=1024))
    yield running
    running.stop()


@pytest.mark.slow
def test_100_json_schema_completions_at_temperature_1_all_validate(server: RunningServer):
    async def one(client: openai.AsyncOpenAI) -> str | None:
        reply = await client.chat.completions.create(
            model=server.model,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=64,
            temperature=1.0,
            response_format=PERSON_FORMAT,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content

    async def run_all() -> list[str | None]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client) for _ in range(NUM_JSON_COMPLETIONS)))

    start = time.monotonic()
    texts = asyncio.run(run_all())
    print(f"{NUM_JSON_COMPLETIONS} json_schema completions in {time.monotonic() - start:.1f} s")
    problems = [p for p in map(person_problem, texts) if p is not None]
    assert problems == []
    assert len(set(texts)) > 10  # really sampled, not one answer repeated


async def _constrained_requests(client: openai.AsyncOpenAI, model: str) -> dict[str, Any]:
    """One request per constraint and endpoint, all at once (they share the batch)."""
    chat, complete = client.chat.completions.create, client.completions.create

    async def streamed() -> tuple[str, str | None]:
        stream = await chat(
            model=model,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=64,
            seed=3,
            stream=True,
            response_format=PERSON_FORMAT,  # type: ignore[arg-type]
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].choices[0].finish_reason

    calls = {
        "streamed_schema": streamed(),
        "completion_schema": complete(
            model=model, prompt="A user as JSON:", max_tokens=64, n=2, seed=1,
            extra_body={"response_format": PERSON_FORMAT},
        ),
        "json_object": chat(
            model=model, messages=ASK, max_tokens=64, temperature=0.0,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
        ),
        "text": chat(
            model=model, messages=ASK, max_tokens=8, temperature=0.0,  # type: ignore[arg-type]
            response_format={"type": "text"},
        ),
        "regex": complete(
            model=model, prompt="Call us at", max_tokens=24, n=2, seed=0,
            extra_body={"structured_outputs": {"regex": REGEX}},
        ),
        "guided_regex": chat(
            model=model, messages=[{"role": "user", "content": "Pick a date."}],
            max_tokens=24, extra_body={"guided_regex": DATE},
        ),
        "guided_choice": chat(
            model=model, messages=[{"role": "user", "content": "Your favourite colour?"}],
            max_tokens=16, n=3, seed=2, extra_body={"guided_choice": COLORS},
        ),
        "choice": complete(
            model=model, prompt="Yes or no?", max_tokens=16, logprobs=3,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        ),
        "grammar": complete(
            model=model, prompt="Add two numbers:", max_tokens=16,
            extra_body={"structured_outputs": {"grammar": GRAMMAR}},
        ),
    }  # fmt: skip
    results = await asyncio.gather(*calls.values())
    return dict(zip(calls, results))


def test_every_constraint_on_both_endpoints(server: RunningServer):
    async def run() -> dict[str, Any]:
        async with server.async_client() as client:
            return await _constrained_requests(client, server.model)

    got = asyncio.run(run())
    text, reason = got["streamed_schema"]
    assert person_problem(text) is None and reason == "stop"
    assert [person_problem(c.text) for c in got["completion_schema"].choices] == [None] * 2
    assert isinstance(json.loads(got["json_object"].choices[0].message.content), dict)
    assert got["text"].choices[0].finish_reason == "length"  # "text": no constraint
    for c in got["regex"].choices:
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "stop", c.text
    assert re.fullmatch(DATE, got["guided_regex"].choices[0].message.content)
    assert {c.message.content for c in got["guided_choice"].choices} <= set(COLORS)
    choice = got["choice"].choices[0]
    assert choice.text in ("yes", "no")
    # Logprobs of the masked distribution: the chosen token is allowed, so finite.
    assert choice.logprobs.token_logprobs[0] > -9999.0
    assert re.fullmatch(r"sum\([1-9][0-9]?, [1-9][0-9]?\)", got["grammar"].choices[0].text)


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format", "invalid JSON schema: Invalid type"),
        (
            {"structured_outputs": {"json": {"type": "string", "minLength": 5, "maxLength": 2}}},
            "structured_outputs",
            "Unsatisfiable schema",
        ),
        ({"guided_regex": "(("}, "guided_regex", "invalid regex.*unclosed group"),
        ({"guided_grammar": "start: nope"}, "guided_grammar", "invalid grammar"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must list"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
        (
            {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
            "guided_choice",
            "in one field only",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is req"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ],
)
def test_a_rejected_constraint_is_a_400_naming_its_field(
    server: RunningServer, extra: dict[str, Any], param: str, message: str
):
    body = {"model": server.model, "messages": ASK, "max_tokens": 8, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert re.search(message, error["message"], re.S), error["message"]
    with pytest.raises(openai.BadRequestError):  # the official client raises it too
        server.client().chat.completions.create(
            model=server.model,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body=extra,
        )


def test_the_server_keeps_serving_after_a_rejected_schema(server: RunningServer):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=server.model,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=8,
            response_format=BAD_SCHEMA,  # type: ignore[arg-type]
        )
    assert caught.value.status_code == 400 and caught.value.param == "response_format"
    reply = client.chat.completions.create(
        model=server.model,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=64,
        seed=5,
        response_format=PERSON_FORMAT,  # type: ignore[arg-type]
    )
    assert person_problem(reply.choices[0].message.content) is None


def test_the_docs_python_example_runs(server: RunningServer):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    code = python_example(doc, "### Structured outputs")
    scope: dict[str, Any] = {"client": server.client()}
    exec(compile(code, "docs/server.md", "exec"), scope)
    assert isinstance(scope["user"], dict) and "name" in scope["user"]
    assert scope["out"].choices[0].text in ("yes", "no")


def test_responses_text_format_json_schema(server: RunningServer):
    """/v1/responses takes the constraint as `text.format` (name and schema at its top)."""
    client = server.client()
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    resp = client.responses.create(
        model=server.model,
        input=ASK[0]["content"],
        max_output_tokens=64,
        text={"format": fmt},  # type: ignore[typeddict-item]
    )
    assert person_problem(resp.output_text) is None, resp.output_text
    assert resp.text.format.type == "json_schema"
    plain = client.responses.create(
        model=server.model,
        input="Say hi.",
        max_output_tokens=8,
        text={"format": {"type": "json_object"}},
    )
    assert plain.status == "incomplete" or isinstance(json.loads(plain.output_text), dict)
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=server.model, input="x", text={"format": bad})  # type: ignore[typeddict-item]
    assert caught.value.body["param"] == "text"
    assert "invalid JSON schema" in caught.value.body["message"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_tool_choice_constrain_the_call(server: RunningServer, tool_choice):
    reply = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice=tool_choice,
        max_tokens=48,
        temperature=1.0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_required_and_named_tool_choice_constrain_the_call(
    server: RunningServer, tool_choice: Any
) -> None:
    flat = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's shape
    reply = server.client().responses.create(
        model=server.model,
        input="What is the weather in Paris?",
        tools=[flat],  # type: ignore[list-item]
        tool_choice=tool_choice,
        max_output_tokens=48,
        temperature=1.0,
    )
    assert reply.status == "completed", reply
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
