"""KVzip on CUDA (Triton kernels, decode graphs) against the CPU reference path: the
reconstruction pass's scores, the kept entries and the greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import MATRIX_PROMPTS
from sparsevllm import LLM, SamplingParams
from sparsevllm.sparse.kvzip import KVzip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KNOBS = dict(
    sparse_method="kvzip",
    decode_keep_tokens=24,
    sink_keep_tokens=2,
    recent_keep_tokens=4,
    kvzip_chunk_size=16,
    dtype="float32",
    chunk_prefill_size=16,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def scored(model: str, **kwargs):
    """(greedy tokens, each (request, layer)'s `[Hkv, L]` scores, the engine)."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    score = KVzip.score

    def record(self, layer, step, kv, attn):
        out = score(self, layer, step, kv, attn)
        got[(step.seq_id, layer)] = out.float().cpu()
        return out

    with pytest.MonkeyPatch.context() as patch:  # undone before the next engine runs
        patch.setattr(KVzip, "score", record)
        llm = LLM(model, **{**KNOBS, **kwargs})
        outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], got, llm


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_scores_and_tokens_match_cpu(model, eager):
    cpu_tokens, cpu_scores, _ = scored(model, device="cpu")
    gpu_tokens, gpu_scores, llm = scored(
        model, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1
    )
    assert llm.engine.runner.backend.name == "triton"
    assert (llm.engine.runner.graphs is None) == eager
    assert sorted(gpu_scores) == sorted(cpu_scores) and cpu_scores
    for key, want in cpu_scores.items():
        finite = torch.isfinite(want)
        torch.testing.assert_close(gpu_scores[key][finite], want[finite], rtol=1e-4, atol=1e-6)
    assert gpu_tokens == cpu_tokens
    assert llm.stats()["scoring_passes"] == 3


def test_forced_pass_without_eviction_keeps_vanilla_tokens_with_graphs(model, monkeypatch):
    monkeypatch.setattr(KVzip, "evicts", lambda self, resident: True)
    common = dict(device="cuda", dtype="float32", chunk_prefill_size=16, kv_cache_memory_gb=1)
    van = LLM(model, **common).generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(model, sparse_method="kvzip", decode_keep_tokens=4096, **common)
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van]
    assert llm.stats()["scoring_passes"] == len(MATRIX_PROMPTS)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_quantized_formats_score_close_to_the_cpu_path(model, fmt):
    _, cpu, _ = scored(model, device="cpu", kv_cache_dtype=fmt)
    _, gpu, llm = scored(model, device="cuda", kv_cache_dtype=fmt, kv_cache_memory_gb=1)
    for key, want in cpu.items():
        finite = torch.isfinite(want)
        # The kernels quantize on store as the reference does; what differs is rounding.
        torch.testing.assert_close(gpu[key][finite], want[finite], rtol=5e-2, atol=1e-2)
    assert llm.stats()["kv_slots_used"] == llm.stats()["kv_slots_cached"]
