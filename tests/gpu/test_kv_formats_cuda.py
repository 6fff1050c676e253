"""Quantized KV storage on CUDA (Triton quantize-on-store, decode and prefill reading
int8 / fp8 elements with their scales, CUDA-graph decode) against the CPU reference."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1] + list(range(10, 70)), [1] + list(range(100, 125)), [1, 5, 6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TOP2 = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
# A quantized element whose float32 input differs by an ulp between the devices may round
# to the neighbouring code: the two runs may part only where the reference's two best
# tokens are this close (nats), and agree on the logprobs until then.
NEAR_TIE, LOGPROB_ATOL = 0.02, 0.01


def _assert_same_greedy(want, got) -> None:
    """`got`'s greedy tokens equal `want`'s up to the end or up to a step where `want`'s
    top two logprobs were a near-tie (then the two continue from different contexts);
    the chosen tokens' logprobs agree until then."""
    for i, (w, g) in enumerate(zip(want, got)):
        for step, (a, b) in enumerate(zip(w.outputs[0].logprobs, g.outputs[0].logprobs)):
            if a.token_id != b.token_id:
                (_, first), (_, second) = a.top_logprobs[:2]
                assert first - second < NEAR_TIE, (
                    f"prompt {i} step {step}: {b.token_id} instead of {a.token_id}, the "
                    f"reference's top two {first:.4f} / {second:.4f} are not a near-tie"
                )
                break
            assert abs(a.logprob - b.logprob) < LOGPROB_ATOL, (
                f"prompt {i} step {step}: logprob {b.logprob:.5f} vs {a.logprob:.5f}"
            )


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("method", ["vanilla", "streamingllm", "h2o"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_quantized_kv_on_cuda_matches_the_cpu_reference(model, method, fmt, eager):
    kwargs = dict(
        sparse_method=method, kv_cache_dtype=fmt, dtype="float32", chunk_prefill_size=16,
        **METHOD_KNOBS[method],
    )  # fmt: skip
    cpu = LLM(model, device="cpu", **kwargs).generate(PROMPTS, TOP2, use_tqdm=False)
    llm = LLM(model, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1, **kwargs)
    _assert_same_greedy(cpu, llm.generate(PROMPTS, TOP2, use_tqdm=False))
    assert llm.engine.runner.kv_storage[0].k.dtype != torch.float32  # really quantized


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_bf16_model_with_quantized_kv_generates_like_its_bf16_kv(model, fmt):
    """A bf16 model: the quantized KV's greedy tokens stay close to the model dtype's
    (not identical: a lossy format), and the pool holds about twice the slots."""
    common = dict(dtype="bfloat16", device="cuda", kv_cache_memory_gb=0.05)
    dense = LLM(model, **common)
    quant = LLM(model, kv_cache_dtype=fmt, **common)
    a = [o.token_ids for o in dense.generate(PROMPTS, GREEDY, use_tqdm=False)]
    b = [o.token_ids for o in quant.generate(PROMPTS, GREEDY, use_tqdm=False)]
    agree = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    assert agree >= 0.5 * sum(len(p) for p in a)
    ratio = quant.stats()["kv_slots_total"] / dense.stats()["kv_slots_total"]
    assert ratio == pytest.approx(2 * 16 / (16 + 4), rel=0.02)  # head_dim 16: 1 byte + scale
