"""The compiled CPU forward (engine/cpu_compile.py): when it applies, and that it computes
what the eager model does (greedy tokens, prefill and batched and single decode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsevllm import LLM, SamplingParams
from sparsevllm.config import EngineConfig
from sparsevllm.engine import cpu_linear_op
from sparsevllm.engine.cpu_compile import CompiledForward
from sparsevllm.layers.cpu_linear import packing_applies

PROMPTS = [[1, 5, 9, 17, 33, 60], [1, 7, 7, 7], [1, 200, 100, 50, 25, 12, 6, 3, 2]]


def test_config_checks_the_choice():
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(cpu_compile="yes")


def test_auto_leaves_a_tiny_model_eager(tiny_llama):
    """Compiling pays only for models whose steps spend real time in small operators."""
    llm = LLM(tiny_llama, device="cpu")
    assert not isinstance(llm.engine.runner.model, CompiledForward)


def test_on_refuses_what_it_cannot_serve(tiny_model_factory):
    with pytest.raises(ValueError, match="cpu_compile='on'"):
        LLM(tiny_model_factory("mixtral"), device="cpu", cpu_compile="on")


@pytest.mark.skipif(
    not packing_applies(torch.device("cpu"), torch.bfloat16),
    reason="this CPU has no packed bfloat16 GEMM (AVX512-BF16 / AMX)",
)
def test_compiled_bfloat16_matches_eager(tiny_model_factory):
    """bfloat16: the compiled layers read packed weights at every row count and keep
    norms and RoPE in float32 as the eager layers do; Inductor rounds fused elementwise
    chains once instead of per operator, so the comparison is of the first steps'
    distributions (close) and of the greedy tokens where the eager top-2 margin is
    clear of that rounding."""
    path = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = {}
    for choice in ("off", "on"):
        llm = LLM(path, device="cpu", dtype="bfloat16", cpu_compile=choice)
        assert isinstance(llm.engine.runner.model, CompiledForward) == (choice == "on")
        outs[choice] = llm.generate(PROMPTS, params, use_tqdm=False)
    for eager, compiled in zip(outs["off"], outs["on"]):
        assert eager.logprobs is not None and compiled.logprobs is not None
        top_e = eager.logprobs[0].top_logprobs  # the first step: the same prefill
        top_c = compiled.logprobs[0].top_logprobs
        assert [t for t, _ in top_e] == [t for t, _ in top_c]
        for (_, lp_e), (_, lp_c) in zip(top_e, top_c):
            assert abs(lp_e - lp_c) < 0.05
        for step_e, step_c in zip(eager.logprobs, compiled.logprobs):
            margin = step_e.top_logprobs[0][1] - step_e.top_logprobs[1][1]
            if margin > 0.1:  # greedy where no near-tie can flip
                assert step_c.token_id == step_e.token_id
            else:
                break  # a flipped near-tie changes every later step


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_compiled_tokens_match_eager(tiny_model_factory, kind):
    """Llama (llama3 RoPE), Qwen2 (qkv bias) and Qwen3 (q/k norms): three prompts
    prefilled and decoded together, then one alone (a graph of its own: Dynamo
    specialises a single token)."""
    path = tiny_model_factory(kind)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for choice in ("off", "on"):
        llm = LLM(path, device="cpu", cpu_compile=choice)
        assert isinstance(llm.engine.runner.model, CompiledForward) == (choice == "on")
        batch = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].token_ids
        tokens[choice] = (batch, alone)
    assert tokens["on"] == tokens["off"]


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 64])
def test_linear_by_rows_matches_f_linear(rows):
    """The packed oneDNN GEMM (from PACKED_MIN_ROWS rows) computes F.linear's product."""
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    packed = cpu_linear_op.PackedWeights()
    packed.add(weight)
    with packed.active():
        out = cpu_linear_op.linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
