"""RMSNorm variants: Llama / Qwen (weight * normalised x) and Gemma (x * (1 + weight)).

On CUDA both run as one fused Triton kernel (`attention/triton/norm.py`, the same
rounding points), on the CPU as one native call (`layers/cpu_norm.py`, the same rounding
points) where a C compiler built it; the torch ops below define them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.layers.cpu_norm import rms_norm as cpu_rms_norm


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool):
    from sparsevllm.attention.triton.norm import rms_norm  # imports Triton: CUDA only

    return rms_norm(x, weight, eps, gemma)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps, gemma=False)
        native = cpu_rms_norm(x, self.weight, self.eps, gemma=False)
        if native is not None:
            return native
        # One fused operator for HF's pow / mean / rsqrt / multiply in float32: a decode
        # step on the CPU runs 61 of these, and each eager operator costs microseconds.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised x * (1 + weight), all in float32, then cast.

    The weight is stored zero-centred (HF initialises it to zeros), and unlike
    Llama the product is taken before the cast back to the input dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return _fused_rms_norm(x, self.weight, self.eps, gemma=True)
        native = cpu_rms_norm(x, self.weight, self.eps, gemma=True)
        if native is not None:
            return native
        xf = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
