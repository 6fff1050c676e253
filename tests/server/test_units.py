"""Unit tests: AsyncEngine fault isolation (fake engine), stream hold-back, metrics text."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams
from sparsevllm.server.async_engine import (
    AsyncEngine,
    EngineClosed,
    EngineFailure,
    EngineRequest,
    InvalidRequest,
    QueueFull,
)
from sparsevllm.server.formatting import Choice
from sparsevllm.server.metrics import Histogram, ServerMetrics, parse_metrics

BAD, BROKEN = [666], [777]


class FakeEngine:
    """Generates token 5 until max_tokens; add/step failures on demand."""

    tokenizer = None
    max_model_len = 64
    config = SimpleNamespace(model="fake", sparse_method="vanilla")

    def __init__(self) -> None:
        self.live: dict[str, dict[str, Any]] = {}
        self.explode_next_step = False
        self.aborted: list[str] = []

    def stats(self) -> dict[str, Any]:
        return {"num_waiting": 0, "num_running": len(self.live), "kv_slots_used": len(self.live)}

    def add_request(self, ids: list[int], params: SamplingParams, request_id: str) -> str:
        if ids == BAD:
            raise ValueError("token id 666 is outside the vocabulary")
        if ids == BROKEN:
            raise RuntimeError("allocator bug")
        self.live[request_id] = {"n": 0, "max": params.max_tokens, "aborted": False}
        return request_id

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self.live or self.live[request_id]["aborted"]:
            return False
        self.live[request_id]["aborted"] = True
        self.aborted.append(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return any(not r["aborted"] for r in self.live.values())

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        if self.explode_next_step:
            self.explode_next_step = False
            raise RuntimeError("kernel exploded")
        outputs = []
        for request_id, r in list(self.live.items()):
            if not r["aborted"]:
                r["n"] += 1
            done = r["aborted"] or r["n"] >= r["max"]
            reason = "abort" if r["aborted"] else "length"
            outputs.append(
                RequestOutput.single(
                    request_id, None, [1], "", [5] * r["n"], done, reason if done else None
                )
            )
            if done:
                del self.live[request_id]
        return outputs


def request(request_id: str, ids: list[int] | None = None, max_tokens: int = 3) -> EngineRequest:
    return EngineRequest(request_id, ids or [1, 2], SamplingParams(max_tokens=max_tokens))


async def drain(stream) -> list[RequestOutput]:
    outs = []
    while not stream.done:
        outs.append(await stream.next())
    return outs


@pytest.fixture
def engine():
    fake = FakeEngine()
    async_engine = AsyncEngine(fake)
    async_engine.start()
    yield async_engine, fake
    async_engine.stop()
    assert not async_engine.is_alive


def test_bad_requests_fail_alone(engine):
    async_engine, fake = engine

    async def scenario() -> None:
        good = await async_engine.submit([request("a")])
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await async_engine.submit([request("b", BAD)])
        with pytest.raises(EngineFailure, match="allocator bug"):
            await async_engine.submit([request("c", BROKEN)])
        # All or nothing: the good half of a failing submission is rolled back.
        with pytest.raises(InvalidRequest):
            await async_engine.submit([request("d"), request("e", BAD)])
        outs = await drain(good)
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 3

    asyncio.run(scenario())
    assert "d" in fake.aborted and async_engine.is_alive


def test_step_failure_fails_requests_in_flight_not_the_worker(engine):
    async_engine, fake = engine

    async def scenario() -> None:
        stream = await async_engine.submit([request("x", max_tokens=50)])
        await stream.next()
        fake.explode_next_step = True
        last = (await drain(stream))[-1]
        assert last.finish_reason == "error" and "kernel exploded" in last.error
        again = await async_engine.submit([request("y")])
        assert (await drain(again))[-1].finish_reason == "length"

    asyncio.run(scenario())
    assert async_engine.metrics.finished["error"] == 1


def test_abort_queue_limit_and_shutdown(engine):
    async_engine, fake = engine

    async def scenario() -> None:
        with pytest.raises(QueueFull):
            await async_engine.submit([request(f"q{i}") for i in range(3)], max_waiting=2)
        stream = await async_engine.submit([request("long", max_tokens=10_000)])
        await stream.next()
        async_engine.abort(["long"])
        assert (await drain(stream))[-1].finish_reason == "abort"
        slow = await async_engine.submit([request("slow", max_tokens=10_000)])
        async_engine.begin_shutdown(grace_s=0.05)
        assert (await drain(slow))[-1].finish_reason == "abort"
        with pytest.raises(EngineClosed):
            await async_engine.submit([request("late")])

    asyncio.run(scenario())
    assert fake.live == {}


def test_streamed_text_never_shows_a_partial_stop_string():
    choice = Choice(0, 0, "r", stop=["w5 w6"])

    def out(text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput.single("r", None, [], text, [], finished, "stop" if finished else None)

    deltas = [choice.text_delta(out(" w1")), choice.text_delta(out(" w1 w5"))]
    deltas.append(choice.text_delta(out(" w1 ", finished=True)))  # the engine cut the stop
    assert deltas == [" w1", " ", ""] and "".join(deltas) == " w1 "
    other = Choice(0, 0, "r", stop=["w5 w6"])
    parts = [other.text_delta(out(t)) for t in (" w1", " w1 w5", " w1 w5 w7")]
    parts.append(other.text_delta(out(" w1 w5 w7 w8", finished=True)))
    assert "".join(parts) == " w1 w5 w7 w8" and parts[1] == " "  # released once safe


def test_histogram_and_exposition_format():
    hist = Histogram("x_seconds", "help", [0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 3.0):
        hist.observe(value)
    lines = hist.render()
    assert 'sparsevllm:x_seconds_bucket{le="0.1"} 2' in lines
    assert 'sparsevllm:x_seconds_bucket{le="1.0"} 3' in lines
    assert 'sparsevllm:x_seconds_bucket{le="+Inf"} 4' in lines
    assert "sparsevllm:x_seconds_count 4" in lines and "sparsevllm:x_seconds_sum 3.65" in lines
    metrics = ServerMetrics()
    metrics.observe_first_token(0.2)
    metrics.observe_finished("stop", 1.0, 0.01)
    text = metrics.render({"num_running": 2, "kv_slots_used": 5, "kv_slots_total": 10})
    samples = parse_metrics(text)
    assert samples["sparsevllm:num_requests_running"] == 2
    assert samples["sparsevllm:kv_cache_usage_ratio"] == 0.5
    assert samples['sparsevllm:request_success_total{finished_reason="stop"}'] == 1
    assert samples["sparsevllm:time_per_output_token_seconds_count"] == 1
    assert "# TYPE sparsevllm:time_to_first_token_seconds histogram" in text
