"""Continuous batching of concurrent streams, and aborts when clients disconnect."""

from __future__ import annotations

import asyncio
import time

import httpx

from .conftest import TINY_NAME, RunningServer, hang_up_mid_stream

ABORTED = 'sparsevllm:request_success_total{finished_reason="abort"}'
GENERATED = "sparsevllm:generation_tokens_total"


def test_64_concurrent_streams_are_batched(tiny_server: RunningServer, tiny_tokenizer):
    prompts = [f"w{i % 200 + 7} w{(3 * i) % 200 + 7} w5" for i in range(64)]

    async def one(client, i: int) -> tuple[str, object]:
        kwargs = {"max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
        if i % 2:  # half chat, half completions
            messages = [{"role": "user", "content": prompts[i]}]
            stream = await client.chat.completions.create(
                model=TINY_NAME, messages=messages, extra_body={"ignore_eos": True}, **kwargs
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            stream = await client.completions.create(
                model=TINY_NAME, prompt=prompts[i], extra_body={"ignore_eos": True}, **kwargs
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].usage

    async def run_all() -> list[tuple[str, object]]:
        async with tiny_server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    before = tiny_server.metrics()
    results = asyncio.run(run_all())
    for i, (text, usage) in enumerate(results):
        # Special tokens (EOS, ignored here) decode to nothing: at most 8 words.
        assert 0 < len(text.split()) <= 8 and usage.completion_tokens == 8
        if i % 2 == 0:
            assert usage.prompt_tokens == len(tiny_tokenizer.encode(prompts[i]))
        assert usage.total_tokens == usage.prompt_tokens + 8
    after = tiny_server.wait_idle()
    assert after[GENERATED] - before[GENERATED] == 64 * 8
    assert after["sparsevllm:max_concurrent_requests"] > 1  # they shared the batch
    assert after["sparsevllm:num_requests_running"] == 0
    assert after["sparsevllm:time_to_first_token_seconds_count"] >= 64
    assert after["sparsevllm:time_per_output_token_seconds_count"] >= 64
    assert after['sparsevllm:time_to_first_token_seconds_bucket{le="+Inf"}'] >= 64


def test_stream_disconnect_aborts_and_frees_kv_slots(tiny_server: RunningServer):
    before = tiny_server.wait_idle()
    body = {
        "model": TINY_NAME,
        "prompt": "w1 w2 w3",
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    hang_up_mid_stream(tiny_server, body, events=3)
    after = tiny_server.wait_idle()
    assert after[ABORTED] == before[ABORTED] + 1
    assert after["sparsevllm:kv_slots_used"] == 0
    assert after["sparsevllm:num_requests_running"] == 0
    assert after[GENERATED] - before[GENERATED] < 500
    assert tiny_server.client().models.list().data  # still serving


def test_non_stream_disconnect_aborts(tiny_server: RunningServer):
    before = tiny_server.wait_idle()
    body = {"model": TINY_NAME, "prompt": "w1", "max_tokens": 500, "n": 4, "ignore_eos": True}
    started = time.monotonic()
    try:
        httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=0.15)
    except httpx.ReadTimeout:
        pass  # the client gave up and closed the connection
    after = tiny_server.wait_idle()
    assert after[ABORTED] == before[ABORTED] + 4
    assert after["sparsevllm:kv_slots_used"] == 0
    assert after[GENERATED] - before[GENERATED] < 4 * 500
    assert time.monotonic() - started < 30
