"""Overlapped scheduling on CUDA: launching the step scheduled ahead must not wait for the
GPU (any host synchronisation there serialises the two steps again), and the tokens are
those of the plain loop."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.step_loop import StepLoop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1] + list(range(10 + 7 * i, 40 + 9 * i)) for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KNOBS = {m: METHOD_KNOBS[m] for m in ("vanilla", "snapkv", "quest", "omnikv")}


@pytest.mark.parametrize("method", sorted(KNOBS))
def test_step_ahead_launches_without_host_sync(tiny_model_factory, method, monkeypatch):
    model = tiny_model_factory("llama4")
    kwargs = dict(dtype="float32", kv_cache_memory_gb=1, sparse_method=method, **KNOBS[method])
    plain = LLM(model, device="cuda", async_scheduling=False, **kwargs)
    want = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    del plain
    llm = LLM(model, device="cuda", **kwargs)  # overlapped: the default on CUDA
    assert llm.engine.async_scheduling
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # compiles the kernels, captures graphs
    original = StepLoop._schedule_next

    def checked(self, current):
        torch.cuda.set_sync_debug_mode("error")  # raises on any synchronising call
        try:
            return original(self, current)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(StepLoop, "_schedule_next", checked)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert llm.engine.loop.num_steps_ahead >= GREEDY.max_tokens // 2
