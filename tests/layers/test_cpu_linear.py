"""bfloat16 and float32 linears on the CPU over oneDNN-packed weights: the results of
`F.linear`, the parameters and their names unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm import LLM
from sparsevllm.layers.cpu_linear import PackedLinear, pack_weight, packed_linear, packing_applies
from sparsevllm.layers.linear import (
    Projections,
    fuse_projections,
    pack_linears,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(
    not packing_applies(torch.device("cpu"), torch.bfloat16),
    reason="no oneDNN bf16 reorder on this CPU/torch",
)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w = (torch.randn(96, 80) * 0.1).bfloat16()
    b = torch.randn(96).bfloat16()
    x = torch.randn(rows, 80).bfloat16()
    got = packed_linear(x, pack_weight(w), b).float()
    want = (x.double() @ w.double().T + b.double()).float()  # exact products, then rounding
    assert got.shape == (rows, 96)
    # Both accumulate in float32 and round once to bfloat16: within one bf16 step.
    assert torch.allclose(got, want, rtol=2**-7, atol=2**-7)
    assert torch.allclose(got, F.linear(x, w, b).float(), rtol=2**-7, atol=2**-7)


def test_packed_linear_keeps_leading_dims():
    lin = nn.Linear(16, 8).bfloat16()
    x = torch.randn(3, 5, 16).bfloat16()
    packed = PackedLinear(lin)
    assert packed(x).shape == (3, 5, 8)
    assert packed.weight is lin.weight and packed.bias is lin.bias


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(16, 8, bias=False), nn.Linear(16, 4, bias=False)
        self.o_proj = nn.Linear(8, 16, bias=False)
        self.embed = nn.Embedding(10, 16)
        self.lm_head = nn.Linear(16, 10, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.qk = Projections(self.q_proj, self.k_proj)


def test_pack_linears_keeps_names_values_and_ties():
    torch.manual_seed(0)
    block = _Block().bfloat16()
    fuse_projections(block)
    before = {k: v.clone() for k, v in block.state_dict().items()}
    x = torch.randn(4, 16).bfloat16()
    want_qk = block.qk(x)
    want_o, want_head = block.o_proj(want_qk[0]), block.lm_head(x)
    # The fused projection's own linears are never called: only it, o_proj and lm_head pack.
    assert pack_linears(block) == 3
    assert isinstance(block.o_proj, PackedLinear) and isinstance(block.lm_head, PackedLinear)
    assert type(block.q_proj) is nn.Linear
    assert block.lm_head.weight is block.embed.weight
    after = block.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    got_qk = block.qk(x)
    for got, want in zip(got_qk, want_qk):
        assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-7)
    assert torch.allclose(block.o_proj(got_qk[0]).float(), want_o.float(), rtol=2**-6, atol=2**-6)
    assert torch.allclose(block.lm_head(x).float(), want_head.float(), rtol=2**-7, atol=2**-7)
    # Unpacked again (what a compiled CPU forward needs): plain linears, the same ties,
    # names and values, and F.linear's results.
    unpack_linears(block)
    assert type(block.o_proj) is nn.Linear and type(block.lm_head) is nn.Linear
    assert block.qk.packed is None and block.lm_head.weight is block.embed.weight
    assert all(torch.equal(block.state_dict()[k], before[k]) for k in before)
    assert torch.equal(block.lm_head(x), want_head)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_packed_float32_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 80) * 0.1, torch.randn(96), torch.randn(rows, 80)
    got = packed_linear(x, pack_weight(w), b)
    want = (x.double() @ w.double().T + b.double()).float()
    # float32 accumulation in another order than MKL's: equal to a few ulps.
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_engine_packs_cpu_models_in_both_dtypes(tiny_model_factory):
    path = tiny_model_factory("llama")
    for dtype in ("bfloat16", "float32"):
        model = LLM(path, dtype=dtype).engine.runner.model
        assert isinstance(model.lm_head, PackedLinear), dtype
        assert model.model.layers[0].self_attn.qkv.packed is not None, dtype
