"""The native bfloat16 GEMM (layers/cpu_gemm.py, native/gemm_bf16.c) against float64
products of the same bfloat16 values, at the row counts a decode step and a prefill
chunk give, with and without biases, over strided inputs; and where it serves."""

from __future__ import annotations

import pytest
import torch

from sparsevllm import LLM
from sparsevllm.layers import cpu_gemm
from sparsevllm.layers.cpu_gemm import GemmWeight
from sparsevllm.layers.cpu_linear import PackedLinear, pack_weight, packed_linear
from sparsevllm.layers.linear import unpack_linears
from sparsevllm.native.build import cpu_flags

BF16 = torch.bfloat16
serves = cpu_gemm.applies(torch.zeros(32, 32, dtype=BF16))
needs_kernel = pytest.mark.skipif(not serves, reason="no AVX512-BF16 kernel on this CPU")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T  # the bf16 products are exact; float64 sums
    return out if bias is None else out + bias.double()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 12, 13, 16, 25, 300])
@pytest.mark.parametrize("shape", [(96, 80), (33, 64), (70, 2), (1, 130)])
@pytest.mark.parametrize("bias", [None, torch.float32, BF16])
def test_kernel_equals_float64_products_rounded_once(rows, shape, bias):
    torch.manual_seed(rows * 1000 + shape[0])
    n, k = shape
    w = torch.randn(n, k, dtype=BF16)
    b = None if bias is None else torch.randn(n).to(bias)
    x = torch.randn(rows, k, dtype=BF16)
    packed = cpu_gemm.pack(w)
    assert isinstance(packed, GemmWeight) and (packed.out_features, packed.in_features) == (n, k)
    got = cpu_gemm.linear(x, packed, b)
    assert got.dtype == BF16 and got.shape == (rows, n)
    want = _reference(x, w, b)
    # float32 sums (k terms of size ~1) rounded once to bfloat16: one bf16 step of the
    # result plus the float32 sums' error.
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + k * 2**-20 + 1e-6).all(), err.max()


@needs_kernel
def test_kernel_reads_strided_rows_and_packs_strided_weights():
    torch.manual_seed(1)
    base = torch.randn(5, 200, dtype=BF16)
    x = base[:, 8:72]  # rows 200 elements apart
    w_base = torch.randn(40, 90, dtype=BF16)
    w = w_base[:, 10:74]  # a [40, 64] view with row stride 90
    got = cpu_gemm.linear(x, cpu_gemm.pack(w), None)
    want = cpu_gemm.linear(x.contiguous(), cpu_gemm.pack(w.contiguous()), None)
    assert torch.equal(got, want)
    assert torch.allclose(got.double(), _reference(x, w, None), rtol=2**-7, atol=1e-3)


@needs_kernel
def test_kernel_refuses_other_inputs():
    packed = cpu_gemm.pack(torch.randn(8, 8, dtype=BF16))
    with pytest.raises(TypeError, match="float32"):
        cpu_gemm.linear(torch.randn(2, 8), packed, None)


def test_where_the_kernel_serves():
    # Odd input features and other dtypes keep oneDNN; the kernel serves bfloat16
    # wherever this build has it, on AMX processors up to AMX_MAX_ROWS rows.
    assert not cpu_gemm.applies(torch.zeros(8, 7, dtype=BF16))
    assert not cpu_gemm.applies(torch.zeros(8, 8))
    assert not cpu_gemm.applies(torch.zeros(8, 8, dtype=torch.float16))
    if serves:
        w = torch.zeros(8, 8, dtype=BF16)
        dense = cpu_gemm.pack(w).dense
        assert (
            (dense is w or dense.data_ptr() == w.data_ptr())
            if "amx_bf16" in cpu_flags()
            else dense is None
        )
        assert isinstance(pack_weight(torch.zeros(8, 8, dtype=BF16)), GemmWeight)
        odd = pack_weight(torch.zeros(8, 7, dtype=BF16))
        assert isinstance(odd, torch.Tensor) and odd.is_mkldnn


@needs_kernel
def test_packed_linear_keeps_leading_dims_with_the_kernel():
    torch.manual_seed(2)
    lin = torch.nn.Linear(16, 24).to(BF16)
    packed = PackedLinear(lin)
    assert isinstance(packed.packed, GemmWeight)
    x = torch.randn(3, 5, 16, dtype=BF16)
    got = packed(x)
    assert got.shape == (3, 5, 24)
    assert torch.equal(
        got, packed_linear(x.reshape(15, 16), packed.packed, lin.bias).view(3, 5, 24)
    )
    want = _reference(x.reshape(15, 16), lin.weight, lin.bias).view(3, 5, 24)
    assert torch.allclose(got.double(), want, rtol=2**-7, atol=2**-7)


@needs_kernel
def test_engine_serves_bfloat16_through_the_kernel(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), dtype="bfloat16")
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.lm_head.packed, GemmWeight)
    assert isinstance(model.model.layers[0].self_attn.qkv.packed, GemmWeight)
    prompt = list(range(3, 40))
    got = llm.prompt_logits(prompt).float()
    unpack_linears(model)  # the same model over F.linear
    want = llm.prompt_logits(prompt).float()
    # bfloat16 activations through the layers: equal up to a few bf16 rounding steps.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_kernel
def test_amx_processors_send_large_products_to_onednn(monkeypatch):
    # Decode-sized products stay with the kernel; a prefill's go to F.linear over the
    # dense weight (oneDNN's AMX kernels on such a processor).
    monkeypatch.setattr(cpu_gemm, "_amx", lambda: True)
    torch.manual_seed(3)
    w, b = torch.randn(48, 32, dtype=BF16), torch.randn(48, dtype=BF16)
    packed = cpu_gemm.pack(w)
    assert packed.dense is not None and packed.dense.data_ptr() == w.data_ptr()
    calls = []
    real = cpu_gemm.F.linear
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    small = torch.randn(cpu_gemm.AMX_MAX_ROWS, 32, dtype=BF16)
    large = torch.randn(cpu_gemm.AMX_MAX_ROWS + 1, 32, dtype=BF16)
    cpu_gemm.linear(small, packed, b)
    assert torch.equal(cpu_gemm.linear(large, packed, b), real(large, w, b))
    assert calls == [cpu_gemm.AMX_MAX_ROWS + 1]
