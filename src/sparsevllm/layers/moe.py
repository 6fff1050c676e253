"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral), transformers 5's layout.

Parameter names and shapes follow transformers' own modules, so a model's
`state_dict()` loads into transformers' class as it is:

    mlp.gate.weight              [E, H]       the router (`TopKRouter`)
    mlp.experts.gate_up_proj     [E, 2I, H]   gate rows then up rows, per expert
    mlp.experts.down_proj        [E, H, I]

Checkpoint files store one tensor per expert and projection;
`models/expert_weights.py` stacks them when a model is loaded.

On CUDA the experts run as the fused Triton kernel (`attention/triton/moe.py`: tokens
sorted by expert on the device, grouped GEMMs, graph-safe); elsewhere as
`reference_experts`, a loop over the experts that defines the numerics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.layers.activation import get_activation


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    normalize: bool,
    float32_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the top_k of them, renormalised to sum to 1
    when `normalize`; returns (weights `[T, K]`, ids `[T, K]`). The weights are rounded
    to the logits' dtype (Qwen3-MoE) unless `float32_weights` (Mixtral keeps them)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(router_logits.dtype)), ids


def reference_experts(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2I, H]
    down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """The experts one by one over the tokens routed to each: `[T, H]`."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)  # the tokens routed to e, and which of their k
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)  # [n, I] each
        y = F.linear(act(gate) * up, down[e])  # [n, H]
        out.index_add_(0, tok, (y * topk_weights[tok, slot, None]).to(out.dtype))
    return out


class TopKRouter(nn.Module):
    """The router (`mlp.gate`): a bias-free linear map to one logit per expert."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        float32_weights: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize
        self.float32_weights = float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, E]
        return route(logits, self.top_k, self.normalize, self.float32_weights)


class Experts(nn.Module):
    """E gated-MLP experts as stacked weights (`mlp.experts`)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act_name = act
        self.act = get_activation(act)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda and self.act_name in ("silu", "swish"):
            from sparsevllm.attention.triton.moe import fused_moe  # imports Triton: CUDA only

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return reference_experts(
            x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.act
        )


class SparseMoeBlock(nn.Module):
    """Router + experts: each token's output is the weighted sum of its top_k experts."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        act: str,
        float32_weights: bool = False,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, normalize, float32_weights)
        self.experts = Experts(hidden, intermediate, num_experts, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, K] each
        return self.experts(x, weights, ids)  # [T, H]
