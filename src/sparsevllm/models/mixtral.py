"""Mixtral (8x7B, 8x22B): Llama attention, sparse-MoE feed-forward in every layer.

Following transformers' `modeling_mixtral.py`: the router keeps `num_experts_per_tok`
of `num_local_experts` experts (of `intermediate_size` each) and always renormalises
their weights. Checkpoints name the block `block_sparse_moe` and the projections
w1 (gate), w3 (up), w2 (down); they load into transformers 5's stacked layout
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsevllm.layers.moe import SparseMoeBlock
from sparsevllm.models.expert_weights import stack_expert_weights
from sparsevllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            True,
            config.hidden_act,
            float32_weights=True,  # transformers' Mixtral router does not round them
        )


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MixtralDecoderLayer

    @classmethod
    def attn_kwargs_for(cls, config: Any) -> dict[str, bool]:
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("Mixtral with a sliding_window is not supported")
        return {"qkv_bias": False, "o_bias": False}

    def remap_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`block_sparse_moe.experts.<e>.w1/w3/w2` -> the stacked expert parameters."""
        return stack_expert_weights(
            state, self.config.num_local_experts, ("w1", "w3", "w2"), "block_sparse_moe"
        )
