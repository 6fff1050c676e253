"""Fused projections: one GEMM, the same outputs, Hugging Face parameter names kept."""

from __future__ import annotations

import torch
from torch import nn

from sparsevllm import LLM
from sparsevllm.layers.linear import Projections, fuse_projections


def test_fused_projections_match_the_separate_ones():
    torch.manual_seed(0)
    linears = [nn.Linear(16, n, bias=True) for n in (12, 4, 4)]
    x = torch.randn(5, 16)
    want = [lin(x) for lin in linears]
    proj = Projections(*linears)
    holder = nn.Module()
    holder.proj = proj  # a plain attribute, as in the attention modules
    fuse_projections(holder)
    got = proj(x)
    assert proj.weight.shape == (20, 16)
    assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    # The parameters are views into the fused weight: loading new values updates it.
    with torch.no_grad():
        linears[1].weight.fill_(0.5)
        linears[2].bias.fill_(-1.0)
    assert torch.equal(proj.weight[12:16], torch.full((4, 16), 0.5))
    assert torch.equal(proj.bias[16:], torch.full((4,), -1.0))


def test_engine_models_are_fused_with_hf_names(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), dtype="float32")
    model = llm.engine.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv.weight is not None and mlp.gate_up.weight is not None
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.q_proj.out_features :].data_ptr()
    names = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("qkv" in n or "gate_up" in n for n in names)
