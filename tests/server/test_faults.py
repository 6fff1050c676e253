"""Injected faults at the server: one request failing inside its step, and clients
sending faster than the engine serves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api_fuzz import error_shape_problem
from sparsevllm.engine.engine import LLMEngine
from sparsevllm.engine.sequence import Sequence

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

POISON = 250  # a prompt holding this token id fails in its third decode step


def inject_fault(engine: LLMEngine) -> None:
    def fault(seq: Sequence, token: int) -> None:
        if POISON in seq.prompt_token_ids and len(seq.output_token_ids) == 3:
            raise RuntimeError("injected fault")

    engine.token_observers.append(fault)


@pytest.fixture(scope="module")
def faulty(tiny_path: str) -> Iterator[RunningServer]:
    config = tiny_config(tiny_path, max_num_seqs=4)
    running = start_server(
        config, served_model_name=TINY_NAME, max_queue_len=8, engine_setup=inject_fault
    )
    yield running
    running.stop()


async def complete(client: httpx.AsyncClient, prompt: list[int], stream: bool) -> Any:
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line[:7] == "data: {"]
    return r.status_code, events


def test_a_fault_in_one_request_fails_it_alone(faulty: RunningServer):
    good = [[1, 10 + i, 20 + i, 30 + i] for i in range(4)]
    bad = [1, POISON, 40]

    async def scenario() -> list[Any]:
        async with httpx.AsyncClient(base_url=faulty.url, timeout=60) as client:
            jobs = [complete(client, p, stream=i % 2 == 0) for i, p in enumerate(good)]
            jobs += [complete(client, bad, stream=False), complete(client, bad, stream=True)]
            return await asyncio.gather(*jobs)

    *fine, (status, plain), (stream_status, events) = asyncio.run(scenario())
    assert status == 500 and error_shape_problem(plain) is None
    assert "injected fault" in plain.json()["error"]["message"]
    # A stream has sent its 200 already: it ends with an error event instead.
    assert stream_status == 200 and "injected fault" in events[-1]["error"]["message"]
    for i, (code, answer) in enumerate(fine):
        assert code == 200
        usage = answer[-1]["usage"] if i % 2 == 0 else answer.json()["usage"]
        assert usage["completion_tokens"] == 12
    m = faulty.wait_idle()
    assert m["sparsevllm:kv_slots_used"] == 0 and m["sparsevllm:num_requests_running"] == 0
    assert m['sparsevllm:request_success_total{finished_reason="error"}'] == 2


def test_a_flood_gets_429s_not_5xx_nor_a_pile(faulty: RunningServer):
    """64 clients at once against 4 running + 8 waiting: the rest are refused at once."""
    prompt = " ".join(f"w{i % 200 + 7}" for i in range(300))

    async def one(client: httpx.AsyncClient) -> int:
        body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 4}
        return (await client.post("/v1/completions", json=body)).status_code

    async def flood() -> list[int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=faulty.url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c) for _ in range(64)))

    statuses = asyncio.run(flood())
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 32
    assert statuses.count(200) >= 4
    m = faulty.wait_idle()
    assert m["sparsevllm:num_requests_waiting"] == 0 and m["sparsevllm:kv_slots_used"] == 0
    r = httpx.post(faulty.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2})
    assert r.status_code == 200  # serving again once the flood drained
