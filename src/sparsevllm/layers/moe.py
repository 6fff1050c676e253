"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral), transformers 5's layout.

Parameter names and shapes follow transformers' own modules, so a model's
`state_dict()` loads into transformers' class as it is:

    mlp.gate.weight              [E, H]       the router (`TopKRouter`)
    mlp.experts.gate_up_proj     [E, 2I, H]   gate rows then up rows, per expert
    mlp.experts.down_proj        [E, H, I]

Checkpoint files store one tensor per expert and projection; `stack_expert_weights`
turns those into the stacked tensors when a model is loaded.

On CUDA the experts run as the fused Triton kernel (`attention/triton/moe.py`: tokens
sorted by expert on the device, grouped GEMMs, graph-safe); elsewhere as
`reference_experts`, a loop over the experts that defines the numerics.
"""

from __future__ import annotations

import re
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


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts that `num_tokens` tokens, each routed to `top_k` distinct
    experts uniformly at random, activate: E * (1 - (1 - k/E)^T). 64 tokens x 8 of 128
    experts: 125.9 (nearly all); one token: k."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


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


def stack_expert_weights(
    state: dict[str, torch.Tensor],
    num_experts: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    block: str = "mlp",
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors `<prefix>.<block>.experts.<e>.<gate|up|down>.weight` (one per
    expert) -> `<prefix>.mlp.experts.gate_up_proj` / `down_proj`, stacked.

    `names` are the checkpoint's projection names (Mixtral: w1, w3, w2); `block` the
    checkpoint's name of the MoE block (Mixtral: block_sparse_moe; its router is renamed
    to `mlp.gate` too). Tensors are moved out of `state` as they are stacked, so the peak
    is one layer above the checkpoint. Already-stacked checkpoints pass through.
    """
    pattern = re.compile(rf"^(.*)\.{block}\.experts\.(\d+)\.({'|'.join(names)})\.weight$")
    layers: dict[str, dict[tuple[str, int], str]] = {}
    out: dict[str, torch.Tensor] = {}
    for key in list(state):
        m = pattern.match(key)
        if m is None:
            out[key.replace(f".{block}.gate.", ".mlp.gate.")] = state.pop(key)
        else:
            layers.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = key
    for prefix, keys in layers.items():
        for proj in names:
            missing = [e for e in range(num_experts) if (proj, e) not in keys]
            if missing:
                raise ValueError(f"checkpoint lacks {prefix}.{block}.experts.{missing[0]}.{proj}")
        # [gate_0, up_0, down_0, gate_1, ...]: `names` gives the order.
        take = [state.pop(keys[(p, e)]) for e in range(num_experts) for p in names]
        gate_up = [torch.cat([take[3 * e], take[3 * e + 1]]) for e in range(num_experts)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack(take[2::3])
    return out
