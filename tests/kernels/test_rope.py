"""The fused RoPE kernel against the torch definition in layers/rotary.py."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from conftest import LLAMA3_ROPE as LLAMA3  # noqa: E402
from sparsevllm.attention.triton import apply_rope  # noqa: E402
from sparsevllm.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2), (5, 5)])  # GQA; a head count not a power of 2
@pytest.mark.parametrize("params", [{"rope_theta": 10000.0}, LLAMA3], ids=["default", "llama3"])
def test_rope_matches_torch(dtype, heads, params):
    hq, hkv = heads
    d, t = 64, 9
    rope = RotaryEmbedding(d, 4096, {"rope_type": "default", **params})
    g = torch.Generator().manual_seed(0)
    # q and k as views of one fused projection output, like the models' qkv split.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 1000, 4095, 5])
    want_q, want_k = rope(positions, q, k)  # the torch path (CPU tensors)
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    got_q, got_k = apply_rope(
        dev(positions), dev(q), dev(k), dev(rope.cos_cache), dev(rope.sin_cache)
    )
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got_q.dtype == dtype and got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q.cpu(), want_q, **tol)
    torch.testing.assert_close(got_k.cpu(), want_k, **tol)


def test_rope_rejects_bad_shapes():
    cos = torch.zeros(16, 32, device=DEVICE)
    q = torch.zeros(3, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="bad shapes"):
        apply_rope(torch.zeros(3, dtype=torch.long, device=DEVICE), q, q[:2], cos, cos)
