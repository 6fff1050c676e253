"""A fault inside one request's part of a step fails that request alone: its output ends
with finish_reason "error" and the message, its KV slots are freed, and the requests
beside it finish with the tokens they would have produced anyway (with and without
overlapped scheduling)."""

from __future__ import annotations

import pytest

from sparsevllm import SamplingParams
from sparsevllm.config import EngineConfig
from sparsevllm.engine.engine import LLMEngine
from sparsevllm.engine.sequence import Sequence

PROMPTS = [[1] + list(range(10 + 5 * i, 30 + 5 * i)) for i in range(4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(model: str, overlap: bool, caching: bool) -> LLMEngine:
    config = EngineConfig.from_dict(
        {
            "model": model,
            "dtype": "float32",
            "num_kv_slots": 1024,
            "async_scheduling": overlap,
            "enable_prefix_caching": caching,
        }
    )
    return LLMEngine(config)


def run_all(engine: LLMEngine) -> dict[str, object]:
    ids = [engine.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finals  # reported once
                finals[out.request_id] = out
    engine.drain()
    assert sorted(finals) == sorted(ids)
    return finals


@pytest.mark.parametrize(
    "overlap,caching", [(False, False), (True, True)], ids=["plain", "overlap-radix"]
)
def test_a_fault_in_one_request_fails_it_alone(tiny_llama: str, overlap: bool, caching: bool):
    clean = run_all(make_engine(tiny_llama, overlap, caching))
    engine = make_engine(tiny_llama, overlap, caching)

    def fault(seq: Sequence, token: int) -> None:
        if seq.request_id == "r2" and len(seq.output_token_ids) == 4:
            raise RuntimeError("injected fault")

    engine.token_observers.append(fault)
    finals = run_all(engine)
    failed = finals["r2"]
    assert failed.finish_reason == "error" and "injected fault" in failed.error
    for rid in ("r0", "r1", "r3"):
        assert finals[rid].finish_reason == "length"
        assert finals[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    # Nothing is held but what the cache keeps (and the failed request kept nothing).
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]
    # The engine goes on serving.
    engine.token_observers.clear()
    assert run_all(engine)["r2"].outputs[0].token_ids == clean["r2"].outputs[0].token_ids
