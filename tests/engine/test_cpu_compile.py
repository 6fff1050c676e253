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

PROMPTS = [[1, 5, 9, 17, 33, 60], [1, 7, 7, 7], [1, 200, 100, 50, 25, 12, 6, 3, 2]]


def test_config_checks_the_choice():
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(cpu_compile="yes")


def test_auto_leaves_a_tiny_model_eager(tiny_llama):
    """Compiling pays only for models whose steps spend real time in small operators."""
    llm = LLM(tiny_llama, device="cpu")
    assert not isinstance(llm.engine.runner.model, CompiledForward)


def test_on_refuses_what_it_cannot_serve(tiny_llama):
    with pytest.raises(ValueError, match="cpu_compile='on'"):
        LLM(tiny_llama, device="cpu", dtype="bfloat16", cpu_compile="on")


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
