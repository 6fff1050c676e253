"""DuoAttention on CUDA (Triton decode kernel with per-KV-head counts, layers cut and
freed) against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from conftest import default_model_file
from engine_helpers import MATRIX_PROMPTS, METHOD_KNOBS
from sparsevllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
KNOBS = {"sparse_method": "duoattention", **METHOD_KNOBS["duoattention"]}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def tokens(llm: LLM, prompts=MATRIX_PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_matches_cpu(model, sparsity, eager):
    kwargs = dict(KNOBS, dtype="float32", chunk_prefill_size=16, duoattention_sparsity=sparsity)
    cpu = tokens(LLM(model, device="cpu", **kwargs))
    gpu = LLM(model, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1, **kwargs)
    assert tokens(gpu) == cpu
    assert gpu.engine.runner.backend.name == "triton"
    stats = gpu.stats()
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]


def test_cuda_streaming_layer_stays_bounded(model):
    llm = LLM(model, device="cuda", dtype="float32", kv_cache_memory_gb=1, **KNOBS)
    engine = llm.engine
    engine.add_request(MATRIX_PROMPTS[0], SamplingParams(max_tokens=120, ignore_eos=True))
    bound = KNOBS["sink_keep_tokens"] + KNOBS["recent_keep_tokens"]
    bound += KNOBS["duoattention_interval"]
    peaks = []
    while engine.has_unfinished_requests():
        engine.step()
        peaks.append(engine.stats()["kv_slots_used_per_layer"][2])  # layer 2 streams whole
    assert max(peaks) <= bound


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_cuda_quantized_kv_matches_cpu(model, fmt):
    kwargs = dict(KNOBS, dtype="float32", chunk_prefill_size=16, kv_cache_dtype=fmt)
    cpu = tokens(LLM(model, device="cpu", **kwargs))
    gpu = tokens(LLM(model, device="cuda", kv_cache_memory_gb=1, **kwargs))
    assert gpu == cpu


def test_default_model_with_its_shipped_scores():
    path = default_model_file()
    if path is None:
        pytest.skip("the default model is not installed")
    prompt = "Repeat after me: " + " ".join(f"word{i}" for i in range(300))
    kwargs = dict(sparse_method="duoattention", dtype="float32", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    cpu = LLM(path, device="cpu", **kwargs).generate([prompt], params, use_tqdm=False)
    gpu_llm = LLM(path, device="cuda", kv_cache_memory_gb=1, **kwargs)
    gpu = gpu_llm.generate([prompt], params, use_tqdm=False)
    assert gpu[0].token_ids == cpu[0].token_ids
