"""The native CPU RMSNorm (layers/cpu_norm.py) against the reference form of
layers/norm.py: float32 to its rounding, 16-bit types to the bit (the same rounding
points); the fallbacks where the kernel does not apply."""

from __future__ import annotations

import pytest
import torch

from native_env import needs_c_compiler as needs_kernel
from sparsevllm.layers import cpu_norm, norm
from sparsevllm.layers.norm import GemmaRMSNorm, RMSNorm


def _reference(module: torch.nn.Module, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(norm, "cpu_rms_norm", lambda *args, **kwargs: None)
        return module(x)


@needs_kernel
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (16, 576), (3, 4, 32)])
@torch.no_grad()
def test_native_norm_equals_the_reference_form(cls, dtype, shape, monkeypatch):
    torch.manual_seed(0)
    module = cls(shape[-1]).to(dtype)
    module.weight.copy_(torch.randn(shape[-1]) * 0.5)
    x = torch.randn(*shape, dtype=dtype) * 3
    assert cpu_norm.rms_norm(x, module.weight, module.eps, cls is GemmaRMSNorm) is not None
    got, want = module(x), _reference(module, x, monkeypatch)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    # float32: the mean's summation order; 16-bit: rare ties at the final rounding
    tol = {torch.float32: 1e-6, torch.bfloat16: 0.0, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_kernel
@torch.no_grad()
def test_strided_rows_are_read_in_place():
    x = torch.randn(5, 2, 64)[:, 1]  # rows 128 elements apart
    w = torch.randn(64)
    got = cpu_norm.rms_norm(x, w, 1e-6, False)
    want = w * torch.nn.functional.rms_norm(x, (64,), eps=1e-6)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_where_the_kernel_does_not_apply_it_gives_none():
    x, w = torch.randn(2, 8), torch.randn(8)
    assert cpu_norm.rms_norm(x.to(torch.int32), w, 1e-6, False) is None  # element type
    assert cpu_norm.rms_norm(x, torch.randn(4), 1e-6, False) is None  # weight length
    assert cpu_norm.rms_norm(x.t(), torch.randn(2), 1e-6, False) is None  # column stride
    w.requires_grad_(True)
    assert cpu_norm.rms_norm(x, w, 1e-6, False) is None  # training: torch's autograd
