"""API keys (401), unknown models (404), the waiting-queue limit (429), cached tokens."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from sparsevllm.config import EngineConfig

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

KEY = "sk-test-key"
HAS_PREFIX_CACHE = "enable_prefix_caching" in EngineConfig.field_names()


@pytest.fixture(scope="module")
def guarded(tiny_path: str) -> Iterator[RunningServer]:
    """One running sequence at most, two waiting at most, an API key; prefix cache on."""
    overrides = {"enable_prefix_caching": True} if HAS_PREFIX_CACHE else {}
    config = tiny_config(tiny_path, max_num_seqs=1, **overrides)
    running = start_server(config, served_model_name=TINY_NAME, api_key=KEY, max_queue_len=2)
    yield running
    running.stop()


def test_api_key_is_required_on_v1_only(guarded: RunningServer):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(guarded.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").completions.create(model=TINY_NAME, prompt="w1")
    ok = guarded.client().completions.create(model=TINY_NAME, prompt="w1", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    # The 401 comes before the body is looked at, even for a malformed one.
    r = httpx.post(guarded.url + "/v1/chat/completions", content=b"{")
    assert r.status_code == 401
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200


def test_unknown_model_is_404(guarded: RunningServer):
    client = guarded.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="w1", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "w1"}], max_tokens=2
        )


def test_queue_limit_gives_429(guarded: RunningServer):
    headers = {"Authorization": f"Bearer {KEY}"}

    def body(max_tokens: int) -> dict:
        return {
            "model": TINY_NAME,
            "prompt": "w1 w2 w3",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }

    async def read_all(client: httpx.AsyncClient, max_tokens: int) -> tuple[int, object]:
        async with client.stream("POST", "/v1/completions", json=body(max_tokens)) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            chunks = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            return r.status_code, len(chunks)

    async def scenario() -> tuple[list[tuple[int, int]], tuple[int, int]]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as client:
            # The only running slot is taken by a long request; wait until it runs.
            async with client.stream("POST", "/v1/completions", json=body(500)) as first:
                lines = first.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass
                burst = await asyncio.gather(*(read_all(client, 20) for _ in range(5)))
                rest = [line async for line in lines if line.startswith("data: ")]
            return burst, (first.status_code, len(rest))

    burst, (first_status, _) = asyncio.run(scenario())
    statuses = sorted(status for status, _ in burst)
    assert first_status == 200
    assert statuses == [200, 200, 429, 429, 429]
    # The two that waited ran to completion once the slot was free.
    assert all(n >= 1 for status, n in burst if status == 200)
    error = next(payload for status, payload in burst if status == 429)["error"]
    assert error["code"] == "queue_full" and "limit 2" in error["message"]
    r = httpx.post(guarded.url + "/v1/completions", json=body(1), headers=headers)
    assert r.status_code == 200  # and once the queue drained, requests are accepted again


def test_fan_out_beyond_the_queue_is_400(guarded: RunningServer):
    r = httpx.post(
        guarded.url + "/v1/completions",
        json={"model": TINY_NAME, "prompt": ["w1"] * 3, "max_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    # Three sequences can never fit a queue of two: that is a 400, not a retryable 429.
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.skipif(not HAS_PREFIX_CACHE, reason="the engine has no prefix cache yet")
def test_cached_tokens_in_usage_and_metrics(guarded: RunningServer):
    client = guarded.client()
    prompt = " ".join(f"w{i}" for i in range(10, 210))
    first = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 200
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    metrics = guarded.metrics()
    assert metrics["sparsevllm:prefix_cache_hit_tokens_total"] > 0
    assert json.loads(second.model_dump_json())["usage"]["prompt_tokens_details"]


def test_disconnect_while_queued_aborts_the_waiting_request(guarded: RunningServer):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": TINY_NAME, "prompt": "w1", "stream": True, "ignore_eos": True}
    aborted = 'sparsevllm:request_success_total{finished_reason="abort"}'
    before = guarded.wait_idle()
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 500}) as first:
            lines = first.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # the only running slot is now taken
            with httpx.Client(base_url=guarded.url, headers=headers, timeout=60) as other:
                with other.stream("POST", "/v1/completions", json={**body, "max_tokens": 5}):
                    deadline = time.monotonic() + 10
                    while guarded.metrics()["sparsevllm:num_requests_waiting"] != 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
            # The queued request's client is gone before its first token.
            deadline = time.monotonic() + 10
            while guarded.metrics()["sparsevllm:num_requests_waiting"] != 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert guarded.metrics()["sparsevllm:num_requests_running"] == 1
    after = guarded.wait_idle()
    # The queued one (and the first one too, unless it finished before we hung up).
    assert after[aborted] - before[aborted] >= 1
