"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, sparse-MoE feed-forward.

Following transformers' `modeling_qwen3_moe.py`: layer i has a routed MoE block when
`num_experts > 0`, i is not in `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`,
else a dense gated MLP of `intermediate_size`. The router takes a softmax over the
experts, keeps `num_experts_per_tok` of them and renormalises their weights when
`norm_topk_prob`. Qwen3-MoE has no shared expert. The MoE block changes only the
feed-forward: attention, and so the KV cache and every sparse method, are Qwen3's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsevllm.layers.moe import SparseMoeBlock
from sparsevllm.models.expert_weights import stack_expert_weights
from sparsevllm.models.llama import LlamaDecoderLayer
from sparsevllm.models.qwen3 import Qwen3ForCausalLM


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if not is_moe_layer(config, layer_idx):
            return super().build_mlp(config, layer_idx)
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            bool(getattr(config, "norm_topk_prob", False)),
            config.hidden_act,
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer

    def remap_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-expert checkpoint tensors -> the stacked expert parameters."""
        return stack_expert_weights(state, self.config.num_experts)
