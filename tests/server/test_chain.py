"""The chain cache over HTTP: chain_id (field or header), statuses, 409, GET /v1/cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sparsevllm.server.async_engine import AsyncEngine, EngineClosed

from .conftest import TINY_NAME, RunningServer, snapkv_chain_config, start_server, tiny_config
from .test_units import FakeEngine

HEADER = "X-SparseVLLM-Chain-ID"
KEY = "sk-cache-key"
BUDGET = 16
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def chain_server(tiny_path: str) -> Iterator[RunningServer]:
    """SnapKV with a small budget and its default cross-request mode: the chain cache."""
    config = snapkv_chain_config(tiny_path, BUDGET, enable_prefix_caching=True)
    assert config.prefix_cache_mode == "chain"
    running = start_server(config, served_model_name=TINY_NAME)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def radix_server(tiny_path: str) -> Iterator[RunningServer]:
    """Vanilla attention with the radix prefix cache, behind an API key."""
    config = tiny_config(tiny_path, enable_prefix_caching=True)
    assert config.prefix_cache_mode == "radix"
    running = start_server(config, served_model_name=TINY_NAME, api_key=KEY)
    yield running
    running.stop()


def chat_turn(
    client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: Any
) -> tuple[Any, httpx.Headers]:
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_NAME, messages=messages, **GREEDY, **kwargs
    )
    return raw.parse(), raw.headers


def converse(client: openai.OpenAI, first: str, turns: int, **kwargs: Any) -> list[Any]:
    """A conversation whose turn k+1 resends turn k's messages, its reply and a new message.

    The tiny chat template renders an assistant message as its words, so the resent reply
    tokenizes to exactly the tokens generated: each turn's prompt extends the chain.
    """
    messages = [{"role": "user", "content": first}]
    results = []
    for turn in range(turns):
        result, headers = chat_turn(client, messages, **kwargs)
        assert result.choices[0].finish_reason == "length"
        assert headers[HEADER] == result.chain_id
        results.append(result)
        messages.append({"role": "assistant", "content": result.choices[0].message.content})
        messages.append({"role": "user", "content": f"w{40 + turn} w41 w42"})
    return results


def cache_listing(server: RunningServer, **kwargs: Any) -> dict[str, Any]:
    response = httpx.get(server.url + "/v1/cache", timeout=30, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def chain_entry(listing: dict[str, Any], chain_id: str) -> dict[str, Any]:
    matches = [c for c in listing["chains"] if c["chain_id"] == chain_id]
    assert len(matches) == 1, listing
    return matches[0]


def test_chat_conversation_continues_through_the_body_field(chain_server: RunningServer):
    client = chain_server.client()
    turns = converse(client, "w1 w2 w3 w4 w5 w6", 3, extra_body={"chain_id": "conv-1"})
    assert [t.chain_id for t in turns] == ["conv-1"] * 3
    # An explicit id nobody has used yet: the request starts fresh under that id.
    assert turns[0].chain_status == "not_found"
    assert turns[0].usage.prompt_tokens_details.cached_tokens == 0
    for previous, turn in zip(turns, turns[1:]):
        assert turn.chain_status == "continued"
        # The chain covers the previous turn's prompt and reply but its last token.
        cached = turn.usage.prompt_tokens_details.cached_tokens
        assert cached == previous.usage.prompt_tokens + previous.usage.completion_tokens - 1
    last = turns[-1].usage
    entry = chain_entry(cache_listing(chain_server), "conv-1")
    assert entry["logical_tokens"] == last.prompt_tokens + last.completion_tokens - 1
    # SnapKV keeps a budget: far fewer slots are resident than tokens were processed.
    assert 0 < entry["resident_slots"] < entry["logical_tokens"]
    assert entry["busy"] is False


def test_chat_conversation_continues_through_the_header(chain_server: RunningServer):
    client = chain_server.client()
    turns = converse(client, "w7 w8 w9", 3, extra_headers={HEADER: "conv-header"})
    assert [t.chain_id for t in turns] == ["conv-header"] * 3
    assert [t.chain_status for t in turns] == ["not_found", "continued", "continued"]
    assert all(t.usage.prompt_tokens_details.cached_tokens > 0 for t in turns[1:])


def test_streamed_turn_carries_the_chain_in_every_chunk_and_the_header(
    chain_server: RunningServer,
):
    client = chain_server.client()
    messages = [{"role": "user", "content": "w11 w12 w13"}]
    first, _ = chat_turn(client, messages, extra_body={"chain_id": "conv-stream"})
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "w14"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_NAME,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chain_id": "conv-stream"},
        **GREEDY,
    )
    assert raw.headers[HEADER] == "conv-stream"
    chunks = list(raw.parse())
    assert len(chunks) > 2
    assert {(c.chain_id, c.chain_status) for c in chunks} == {("conv-stream", "continued")}
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_diverging_and_unknown_chains(chain_server: RunningServer):
    client = chain_server.client()
    converse(client, "w20 w21 w22", 1, extra_body={"chain_id": "conv-div"})
    other = [{"role": "user", "content": "w30 w31"}]
    diverged, headers = chat_turn(client, other, extra_body={"chain_id": "conv-div"})
    assert diverged.chain_status.startswith("diverged")
    assert diverged.chain_id == headers[HEADER] == "conv-div"
    assert diverged.usage.prompt_tokens_details.cached_tokens == 0
    # The old chain was dropped; the diverging request's turn now lives under the id.
    entry = chain_entry(cache_listing(chain_server), "conv-div")
    usage = diverged.usage
    assert entry["logical_tokens"] == usage.prompt_tokens + usage.completion_tokens - 1

    unknown, _ = chat_turn(client, other, extra_body={"chain_id": "never-seen"})
    assert (unknown.chain_id, unknown.chain_status) == ("never-seen", "not_found")


def test_completions_token_ids_and_automatic_matching(chain_server: RunningServer):
    """Without a chain_id, a prompt that extends an idle chain continues it by itself."""
    client = chain_server.client()
    prompt = list(range(100, 130))
    first = client.completions.create(model=TINY_NAME, prompt=prompt, logprobs=0, **GREEDY)
    assert first.chain_status == "new" and first.chain_id.startswith("chain-")
    # The reply's token ids, from the token strings of its logprobs.
    tokenizer = chain_server.engine.tokenizer
    reply = tokenizer.convert_tokens_to_ids(first.choices[0].logprobs.tokens)
    assert len(reply) == first.usage.completion_tokens
    follow = client.completions.create(model=TINY_NAME, prompt=prompt + reply + [200], **GREEDY)
    assert (follow.chain_id, follow.chain_status) == (first.chain_id, "continued")
    assert follow.usage.prompt_tokens_details.cached_tokens == len(prompt) + len(reply) - 1
    # A prompt that does not extend it starts a chain of its own.
    other = client.completions.create(model=TINY_NAME, prompt=prompt[:10] + [201], **GREEDY)
    assert other.chain_status == "new" and other.chain_id not in (first.chain_id, None)


def test_concurrent_streams_on_one_chain_one_gets_409(chain_server: RunningServer):
    client = chain_server.client()
    messages = [{"role": "user", "content": "w50 w51 w52"}]
    first, _ = chat_turn(client, messages, extra_body={"chain_id": "conv-busy"})
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "w53"},
    ]

    async def one(aclient: openai.AsyncOpenAI) -> Any:
        try:
            stream = await aclient.chat.completions.create(
                model=TINY_NAME,
                messages=messages,
                stream=True,
                max_tokens=300,
                temperature=0.0,
                extra_body={"chain_id": "conv-busy", "ignore_eos": True},
            )
        except openai.ConflictError as e:
            return e
        return [chunk async for chunk in stream]

    async def both() -> list[Any]:
        async with chain_server.async_client() as aclient:
            return await asyncio.gather(one(aclient), one(aclient))

    results = asyncio.run(both())
    conflicts = [r for r in results if isinstance(r, openai.ConflictError)]
    streams = [r for r in results if not isinstance(r, openai.ConflictError)]
    assert len(conflicts) == 1 and len(streams) == 1
    error = conflicts[0]
    assert error.status_code == 409
    assert error.body["type"] == "conflict" and error.body["param"] == "chain_id"
    assert "busy" in error.body["message"]
    chunks = streams[0]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.chain_status for c in chunks} == {"continued"}
    m = chain_server.wait_idle()
    assert m["sparsevllm:kv_slots_used"] == m["sparsevllm:kv_slots_cached"]
    assert chain_entry(cache_listing(chain_server), "conv-busy")["busy"] is False


def test_chain_id_validation(chain_server: RunningServer):
    url = chain_server.url + "/v1/completions"
    body = {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 2}

    def post(extra: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(url, json={**body, **extra}, headers=headers, timeout=30)

    for bad in ("", "x" * 129, "has space", "caf\u00e9", "tab\there", 5):
        r = post({"chain_id": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "chain_id", r.json()
    r = post({}, headers={HEADER: "has space"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chain_id"
    r = post({"chain_id": "a"}, headers={HEADER: "b"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "chain_id_conflict"
    assert "'a'" in error["message"] and "'b'" in error["message"]
    ok = post({"chain_id": "same"}, headers={HEADER: "same"})
    assert ok.status_code == 200 and ok.headers[HEADER] == "same"
    assert ok.json()["chain_id"] == "same"
    for extra in ({"n": 2}, {"prompt": ["w1", "w2"]}, {"prompt": [[5, 6], [7, 8]]}):
        r = post({"chain_id": "x" * 128, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chain_id"
        assert "n > 1 or several prompts" in r.json()["error"]["message"]
    chat = httpx.post(
        chain_server.url + "/v1/chat/completions",
        json={"model": TINY_NAME, "messages": [{"role": "user", "content": "w1"}], "n": 3},
        headers={HEADER: "conv-n"},
        timeout=30,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "chain_id"


def test_several_choices_report_their_chains_per_choice(chain_server: RunningServer):
    r = httpx.post(
        chain_server.url + "/v1/completions",
        json={"model": TINY_NAME, "prompt": "w60 w61", "max_tokens": 2, "n": 2},
        timeout=30,
    )
    data = r.json()
    assert r.status_code == 200 and HEADER not in r.headers
    assert data["chain_id"] is None and data["chain_status"] is None
    ids = {c["chain_id"] for c in data["choices"]}
    assert len(ids) == 2 and all(c["chain_status"] for c in data["choices"])


def test_idle_chains_metric(chain_server: RunningServer):
    converse(chain_server.client(), "w70 w71", 1, extra_body={"chain_id": "conv-metric"})
    metrics = chain_server.wait_idle()
    listing = cache_listing(chain_server)
    idle = [c for c in listing["chains"] if not c["busy"]]
    assert metrics["sparsevllm:idle_chains"] == len(idle) >= 1
    assert listing["mode"] == "chain" and listing["prefixes"] == []
    assert listing["kv_slots_cached"] == sum(c["resident_slots"] for c in idle)
    assert metrics["sparsevllm:kv_slots_cached"] == listing["kv_slots_cached"]


def test_radix_mode_lists_prefixes_and_needs_the_key(radix_server: RunningServer):
    assert httpx.get(radix_server.url + "/v1/cache").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert cache_listing(radix_server, headers=auth)["prefixes"] == []
    client = radix_server.client()
    raw = client.completions.with_raw_response.create(
        model=TINY_NAME, prompt="w1 w2 w3 w4 w5 w6 w7 w8", **GREEDY
    )
    result = raw.parse()
    # No chain cache: the fields are null and there is no header.
    assert result.chain_id is None and result.chain_status is None
    assert HEADER not in raw.headers
    radix_server.wait_idle()
    listing = cache_listing(radix_server, headers=auth)
    assert listing["mode"] == "radix" and listing["chains"] == []
    tokens = result.usage.prompt_tokens + result.usage.completion_tokens - 1
    assert listing["prefixes"] == [
        {"tokens": tokens, "logical_tokens": tokens, "resident_slots": tokens}
    ]
    assert listing["kv_slots_cached"] == tokens
    assert radix_server.metrics()["sparsevllm:idle_chains"] == 0


def test_engine_call_runs_on_the_worker_and_fails_when_stopped():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def scenario() -> None:
        with pytest.raises(EngineClosed):  # not started yet
            await engine.call(lambda e: 1)
        engine.start()
        assert await engine.call(lambda e: e is fake) is True
        with pytest.raises(ZeroDivisionError):
            await engine.call(lambda e: 1 / 0)
        assert engine.is_alive  # a failing call does not hurt the worker
        await asyncio.to_thread(engine.stop)
        with pytest.raises(EngineClosed):
            await engine.call(lambda e: 1)

    asyncio.run(scenario())
