"""Mixture of experts with shared experts and sigmoid, group-limited routing, as
DeepSeek-V3 defines it (transformers' `DeepseekV3MoE`; GLM-4.5 / GLM-4.7-Flash and
Kimi K2 use the same block). Parameter names and shapes are transformers':

    mlp.gate.weight                            [E, H]  float32, as HF keeps it
    mlp.gate.e_score_correction_bias           [E]     float32
    mlp.experts.gate_up_proj / down_proj       the stacked experts of layers/moe.py
    mlp.shared_experts.{gate,up,down}_proj     one gated MLP of n_shared_experts * I

The routed experts run as `layers/moe.py`'s `Experts` (the per-expert reference loop
on CPU, the fused Triton kernel on CUDA): routing weights are computed here, outside
the kernel, which only takes (weights, ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.layers.mlp import GatedMLP
from sparsevllm.layers.moe import Experts


@dataclass(frozen=True)
class GroupRouting:
    """How a token picks its experts (DeepSeek-V3's `TopkRouter` settings)."""

    top_k: int  # num_experts_per_tok
    n_group: int = 1  # the experts form n_group equal groups ...
    topk_group: int = 1  # ... of which only the topk_group best are eligible
    normalize: bool = True  # norm_topk_prob: the K weights are rescaled to sum to 1
    scaling: float = 1.0  # routed_scaling_factor, applied after the normalisation

    def check(self, num_experts: int) -> None:
        if num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide the {num_experts} experts")
        per_group = num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError("group-limited routing scores a group by its two best experts")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..{self.n_group}")
        if not 1 <= self.top_k <= self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok {self.top_k} must be in 1..{self.topk_group * per_group} "
                "(the experts of the eligible groups)"
            )


def grouped_topk(
    logits: torch.Tensor,  # [T, E] float32 router logits
    bias: torch.Tensor,  # [E] e_score_correction_bias
    routing: GroupRouting,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, K]` float32, ids `[T, K]`), DeepSeek-V3's rule:

    scores are sigmoid(logits); the bias steers only the choice (the weights are the
    unbiased scores); a group's worth is the sum of its two best biased scores and the
    experts outside the topk_group best groups are masked; the top_k biased scores
    choose; weights are renormalised (sum + 1e-20) when `normalize`, then scaled.
    """
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias  # [T, E]
    t, num_experts = choice.shape
    if routing.topk_group < routing.n_group:  # otherwise every group is eligible
        per_group = num_experts // routing.n_group
        groups = choice.view(t, routing.n_group, per_group)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(routing.topk_group, dim=-1).indices  # [T, topk_group]
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        mask = eligible.repeat_interleave(per_group, dim=1)  # [T, E]
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(routing.top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


class GroupLimitedRouter(nn.Module):
    """`mlp.gate`: float32 logits (weights and input, as HF computes them), then
    `grouped_topk`."""

    def __init__(self, hidden: int, num_experts: int, routing: GroupRouting) -> None:
        super().__init__()
        routing.check(num_experts)
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        # A parameter (HF: a buffer) so that checkpoints load it by name like the weights.
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return grouped_topk(logits, self.e_score_correction_bias, self.routing)


class SharedExpertsMoeBlock(nn.Module):
    """Routed experts plus always-active shared experts: `experts(x) + shared(x)`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        num_shared: int,
        routing: GroupRouting,
        act: str,
    ) -> None:
        super().__init__()
        self.gate = GroupLimitedRouter(hidden, num_experts, routing)
        self.experts = Experts(hidden, intermediate, num_experts, act)
        self.shared_experts = (
            GatedMLP(hidden, intermediate * num_shared, act) if num_shared > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, K] each
        out = self.experts(x, weights, ids)  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
