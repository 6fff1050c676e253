"""The mixture-of-experts families on CUDA (fused Triton MoE, CUDA-graph decode) against
the CPU reference path (the loop over experts), and the layer inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from sparsevllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    [1] + list(range(10, 70)),
    [1] + list(range(100, 125)),
    [1, 5, 6],
    [1] + list(range(200, 241)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_matches_cpu_reference(tiny_model_factory, kind, eager):
    model = tiny_model_factory(kind)
    kwargs = dict(dtype="float32", chunk_prefill_size=16)
    cpu = LLM(model, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(model, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1, **kwargs)
    gpu = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert (llm.engine.runner.graphs is None) == eager


def test_fused_layer_replays_in_a_cuda_graph():
    """Routing, the device-side sort and both GEMMs captured once, replayed on new
    inputs of the same shape: the output follows the inputs (nothing was read back to
    the host and frozen at capture)."""
    from sparsevllm.layers.moe import SparseMoeBlock, reference_experts

    torch.manual_seed(0)
    with torch.device("cuda"):
        block = SparseMoeBlock(64, 32, 16, 4, True, "silu")
        torch.nn.init.normal_(block.gate.weight, std=0.5)
        torch.nn.init.normal_(block.experts.gate_up_proj, std=0.1)
        torch.nn.init.normal_(block.experts.down_proj, std=0.1)
        x = torch.randn(24, 64)
    block(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    for seed in (1, 2):
        x.copy_(torch.randn(24, 64, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        w, ids = block.gate(x)
        want = reference_experts(x, block.experts.gate_up_proj, block.experts.down_proj, w, ids)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
