"""/v1/responses through the official openai client: create, stream, previous_response_id
over the prefix cache and the chain cache, GET / DELETE, retention, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from .conftest import TINY_NAME, RunningServer, snapkv_chain_config, start_server, tiny_config

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_output_tokens": 6}
FIRST = "w5 w6 w7 w8 w9 w10 w11 w12"
SECOND = "w20 w21 w22"


@pytest.fixture(scope="module")
def radix_server(tiny_path: str) -> Iterator[RunningServer]:
    """Vanilla with the radix prefix cache; three stored responses at most."""
    config = tiny_config(tiny_path, enable_prefix_caching=True)
    running = start_server(config, served_model_name=TINY_NAME, max_stored_responses=3)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def chain_server(tiny_path: str) -> Iterator[RunningServer]:
    """SnapKV with a small budget: conversations continue through the chain cache."""
    config = snapkv_chain_config(tiny_path, enable_prefix_caching=True)
    assert config.prefix_cache_mode == "chain"
    running = start_server(config, served_model_name=TINY_NAME)
    yield running
    running.stop()


def create(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().responses.create(model=TINY_NAME, **{**GREEDY, **kwargs})


def test_create_returns_the_reply_with_usage(radix_server: RunningServer) -> None:
    resp = create(radix_server, input=FIRST)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete")
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.output_text == resp.output[0].content[0].text
    assert 1 <= resp.usage.output_tokens <= GREEDY["max_output_tokens"]
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # The same conversation as a chat completion gives the same greedy reply.
    chat = radix_server.client().chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": FIRST}],
        temperature=0.0,
        max_tokens=GREEDY["max_output_tokens"],
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_a_length_cut_is_incomplete(radix_server: RunningServer) -> None:
    resp = create(radix_server, input=FIRST, max_output_tokens=1)
    assert resp.usage.output_tokens == 1 and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"


def test_stream_events_build_the_final_response(radix_server: RunningServer) -> None:
    expected = create(radix_server, input=FIRST, store=False)
    events = list(create(radix_server, input=FIRST, stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    done = "response.completed" if expected.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        done,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == expected.output_text
    assert final.usage.output_tokens == expected.usage.output_tokens


def test_previous_response_id_reuses_the_cached_prefix(
    radix_server: RunningServer, tiny_server: RunningServer
) -> None:
    first = create(radix_server, input=FIRST)
    second = create(radix_server, input=SECOND, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # Turn 2 prefills only what is new: the whole first turn came from the cache.
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The same conversation sent whole to an engine without a cache: the same reply.
    history = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": SECOND},
    ]
    fresh = create(tiny_server, input=history)
    assert fresh.usage.input_tokens_details.cached_tokens == 0
    assert fresh.usage.input_tokens == second.usage.input_tokens
    assert fresh.output_text == second.output_text


def test_previous_response_id_continues_the_chain(chain_server: RunningServer) -> None:
    first = create(chain_server, input=FIRST)
    second = create(chain_server, input=SECOND, previous_response_id=first.id)
    extra = second.model_extra or {}
    assert extra["chain_status"] == "continued"
    assert extra["chain_id"] == (first.model_extra or {})["chain_id"]
    # Every token of turn 1 but the last generated one was computed before.
    n_first = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens == n_first - 1
    third = create(chain_server, input="w30", previous_response_id=second.id)
    assert (third.model_extra or {})["chain_status"] == "continued"


def test_get_delete_and_retention(radix_server: RunningServer) -> None:
    client = radix_server.client()
    made = [create(radix_server, input=f"w{40 + i}") for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # the oldest is past the limit of 3
        client.responses.retrieve(made[0].id)
    got = client.responses.retrieve(made[3].id)
    assert got.id == made[3].id and got.output_text == made[3].output_text
    client.responses.delete(made[3].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[3].id)
    with pytest.raises(openai.BadRequestError, match="is not stored") as e:
        create(radix_server, input="w1", previous_response_id=made[3].id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = create(radix_server, input="w2", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_instructions_come_first_and_are_not_carried_over(radix_server: RunningServer) -> None:
    plain = create(radix_server, input=FIRST)
    told = create(radix_server, input=FIRST, instructions="w99 w98")
    # The template renders a system message: "<s> system : w99 w98 </s> " (6 tokens).
    assert told.usage.input_tokens == plain.usage.input_tokens + 6
    assert told.instructions == "w99 w98"
    after = create(radix_server, input=SECOND, previous_response_id=told.id)
    assert after.instructions is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": "w1", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name"),
        ({"input": "w1", "temprature": 0.5}, "temprature"),
        ({"input": [{"role": "robot", "content": "w1"}]}, "input"),
        ({"input": "w1", "max_output_tokens": 10_000}, "max_output_tokens"),
    ],
)
def test_bad_bodies_are_400_and_the_server_keeps_serving(
    radix_server: RunningServer, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{radix_server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "")
    assert create(radix_server, input="w3").status in ("completed", "incomplete")
