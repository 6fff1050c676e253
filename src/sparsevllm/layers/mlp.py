"""The gated feed-forward block (SwiGLU and friends), HF parameter names kept.

`down_proj(act(gate_proj(x)) * up_proj(x))`, gate and up fused into one GEMM after
loading (`layers/linear.py`); SiLU and the product in one native call on the CPU
(`layers/cpu_silu_mul.py`). Llama's dense MLP and the shared experts of the DeepSeek
MoE block (`layers/moe_shared.py`) are this module.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsevllm.layers.activation import get_activation
from sparsevllm.layers.cpu_silu_mul import silu_mul
from sparsevllm.layers.linear import Projections


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = get_activation(act)
        self.silu = act in ("silu", "swish")
        self.gate_up = Projections(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)  # [T, I] each
        native = silu_mul(gate, up) if self.silu else None  # None off the CPU
        hidden = native if native is not None else self.act(gate) * up
        return self.down_proj(hidden)  # [T, H]
