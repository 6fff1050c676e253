"""The server with overlapped scheduling (async_scheduling, the CUDA default; the same
bookkeeping runs on CPU): concurrent streams give the plain server's texts, and a client
hanging up mid-stream still aborts and frees its KV."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import TINY_NAME, RunningServer, hang_up_mid_stream, start_server, tiny_config

ABORTED = 'sparsevllm:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def overlapped_server(tiny_path: str):
    running = start_server(
        tiny_config(tiny_path, async_scheduling=True), served_model_name=TINY_NAME
    )
    yield running
    running.stop()


def _streams(server: RunningServer) -> list[tuple[str, str, int]]:
    """24 concurrent greedy streams: varied lengths, some ending on a stop string."""

    async def one(client, i: int) -> tuple[str, str, int]:
        extra = {"ignore_eos": True}
        stop = ["w9"] if i % 3 == 0 else None
        stream = await client.completions.create(
            model=TINY_NAME,
            prompt=f"w{i + 3} w{2 * i + 5} w7",
            max_tokens=6 + i % 7,
            temperature=0.0,
            stop=stop,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
        return text, reason, chunks[-1].usage.completion_tokens

    async def run_all():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    return asyncio.run(run_all())


def test_overlapped_streams_match_the_plain_server(tiny_server, overlapped_server):
    assert overlapped_server.engine.config.async_scheduling is True
    want = _streams(tiny_server)
    got = _streams(overlapped_server)
    assert got == want
    # The overlap really ran: steps were launched ahead of their predecessors' tokens.
    assert overlapped_server.engine._engine.loop.num_steps_ahead > 0
    assert {reason for _, reason, _ in got} == {"length", "stop"}  # both endings ran
    after = overlapped_server.wait_idle()
    assert after["sparsevllm:kv_slots_used"] == 0
    assert after["sparsevllm:max_concurrent_requests"] > 1


def test_overlapped_stream_disconnect_aborts_and_frees_kv(overlapped_server):
    before = overlapped_server.wait_idle()
    body = {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    hang_up_mid_stream(overlapped_server, body, events=4)  # while steps run ahead
    after = overlapped_server.wait_idle()
    assert after[ABORTED] == before[ABORTED] + 1
    assert after["sparsevllm:kv_slots_used"] == 0
    assert after["sparsevllm:num_requests_running"] == 0
    assert overlapped_server.client().models.list().data  # still serving
