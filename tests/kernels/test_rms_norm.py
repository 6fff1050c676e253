"""The fused RMSNorm kernel against the torch modules that define it (Llama and Gemma)."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, INTERPRET, require_triton

require_triton()

from sparsevllm.attention.triton import rms_norm  # noqa: E402
from sparsevllm.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402


def reference(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's torch definition (its forward on CPU)."""
    return module.cpu()(x.cpu())


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (3, 640), (2, 3, 576), (0, 128)])
def test_rms_norm_matches_module(gemma, dtype, shape):
    g = torch.Generator().manual_seed(0)
    n = shape[-1]
    module = (GemmaRMSNorm if gemma else RMSNorm)(n, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n, generator=g) * 0.5 + (0.0 if gemma else 1.0))
    module = module.to(dtype)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    want = reference(module, x)
    got = rms_norm(x.to(DEVICE), module.weight.to(DEVICE), 1e-6, gemma=gemma).cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif got.numel():
        # The same rounding points: on a GPU at most one bf16 ulp apart on few elements
        # (float32 sums in another order). The CPU interpreter does not round to bf16 to
        # nearest-even, so it gets two ulps and no count.
        diff = (got.float() - want.float()).abs()
        ulps = 2 if INTERPRET else 1
        assert (diff <= ulps * want.float().abs().clamp(min=1e-3) * 2**-7).all()
        if not INTERPRET:
            assert (diff > 0).float().mean() < 0.02


def test_rms_norm_strided_rows_and_errors():
    x = torch.randn(4, 3, 32).to(DEVICE)
    q = x[:, :2]  # [4, 2, 32], rows not evenly strided: normalised from a copy
    w = torch.rand(32).to(DEVICE) + 0.5
    with torch.no_grad():
        module = RMSNorm(32)
        module.weight.copy_(w.cpu())
        want = reference(module, q)
    torch.testing.assert_close(rms_norm(q, w, 1e-6).cpu(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(31, device=DEVICE), 1e-6)
