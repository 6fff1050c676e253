"""The CPU RoPE of layers/rotary.py (the native kernel, and the torch form without it)
against HF's rotate-half formula, to the bit."""

from __future__ import annotations

import pytest
import torch

from native_env import HAS_C_COMPILER
from sparsevllm.layers import cpu_rope, rotary
from sparsevllm.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_equals_the_rotate_half_formula_to_the_bit(dtype, native, monkeypatch):
    """The native kernel keeps the rotation's products and sums apart (no fused
    multiply-adds), and the torch form computes them with a roll: the same bits."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 7, 300, 511])
    q = torch.randn(4, 6, 64, dtype=dtype)
    k = torch.randn(4, 3, 64, dtype=dtype)[:, 1:]  # strided heads: read in place
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)

    def formula(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    if not native:
        monkeypatch.setattr(rotary, "cpu_rope", lambda *args: None)
    elif HAS_C_COMPILER:
        assert cpu_rope.rope(positions, q, k, rope.cos_cache, rope.sin_cache) is not None
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, formula(q)) and torch.equal(got_k, formula(k))
