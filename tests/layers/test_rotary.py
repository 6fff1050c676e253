"""The CPU RoPE of layers/rotary.py against HF's rotate-half formula."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_rotate_half_formula_to_the_bit(dtype):
    """layers/rotary.py computes HF's rotate-half RoPE with a roll: the same products and
    sums, so the same bits."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 7, 300, 511])
    q, k = torch.randn(4, 6, 64, dtype=dtype), torch.randn(4, 2, 64, dtype=dtype)
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)

    def formula(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)

    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, formula(q)) and torch.equal(got_k, formula(k))
