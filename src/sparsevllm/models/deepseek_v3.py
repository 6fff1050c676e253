"""DeepSeek-V3 (and Kimi K2, same architecture) and GLM-4.7-Flash (`glm4_moe_lite`):
multi-head latent attention and a shared-experts MoE, HF parameter names kept.

Following transformers' `modeling_deepseek_v3.py` and `modeling_glm4_moe_lite.py`,
which define the same network with two config classes:

- attention: MLA (`layers/mla.py`); the KV cache holds one latent row per token and
  layer (`slot_layout`), not per-head K and V;
- feed-forward: layer i is a dense gated MLP of `intermediate_size` when
  `mlp_layer_types[i] == "dense"` (GLM) or `i < first_k_dense_replace` (DeepSeek),
  else `n_routed_experts` routed experts of `moe_intermediate_size` with sigmoid,
  group-limited routing plus `n_shared_experts` shared ones (`layers/moe_shared.py`).

Checkpoints store one tensor per expert (stacked at load, `expert_weights.py`); the
multi-token-prediction layers after the last decoder layer are dropped, as transformers
does. FP8 (block-quantized) checkpoints are refused: dequantize them first.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.kv.layout import SlotLayout
from sparsevllm.layers.mla import MLAAttention, mla_layout
from sparsevllm.layers.mlp import GatedMLP
from sparsevllm.layers.moe_shared import GroupRouting, SharedExpertsMoeBlock
from sparsevllm.layers.norm import RMSNorm
from sparsevllm.layers.rotary import RotaryEmbedding, rope_parameters
from sparsevllm.models.expert_weights import stack_expert_weights

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    if not getattr(config, "n_routed_experts", 0):
        return False
    types = getattr(config, "mlp_layer_types", None)  # GLM-4.7-Flash
    if types is not None:
        return bool(types[layer_idx] == "sparse")
    return layer_idx >= (getattr(config, "first_k_dense_replace", 0) or 0)


def routing_of(config: Any) -> GroupRouting:
    n_group = getattr(config, "n_group", None) or 1
    return GroupRouting(
        top_k=config.num_experts_per_tok,
        n_group=n_group,
        topk_group=getattr(config, "topk_group", None) or n_group,
        normalize=bool(getattr(config, "norm_topk_prob", False)),
        scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp: nn.Module
        if is_moe_layer(config, layer_idx):
            self.mlp = SharedExpertsMoeBlock(
                h,
                config.moe_intermediate_size,
                config.n_routed_experts,
                getattr(config, "n_shared_experts", 0) or 0,
                routing_of(config),
                config.hidden_act,
            )
        else:
            self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # RoPE covers the qk_rope_head_dim channels only (transformers: head_dim).
        self.rotary_emb = RotaryEmbedding(
            config.qk_rope_head_dim, max_position, rope_parameters(config)
        )

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, self.rotary_emb, batch)
        return self.norm(x)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = DeepseekV3Model(config, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def check_config(config: Any) -> None:
        """Reject variants whose semantics this implementation does not reproduce."""
        if getattr(config, "quantization_config", None):
            raise ValueError(
                "quantized (FP8 block-scaled) DeepSeek checkpoints are not supported: "
                "load a bf16 conversion"
            )
        if rope_parameters(config).get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("MLA rotates all qk_rope_head_dim channels: partial_rotary_factor 1")

    def slot_layout(self) -> SlotLayout:
        """One `[c_kv, k_pe]` row per token and layer (the runner sizes the pool by it)."""
        return mla_layout(self.config)

    def remap_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Drop the multi-token-prediction layers; stack the per-expert tensors."""
        n = self.config.num_hidden_layers
        for key in list(state):
            m = _LAYER.match(key)
            if m is not None and int(m.group(1)) >= n:
                del state[key]
        return stack_expert_weights(state, getattr(self.config, "n_routed_experts", 0) or 0)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [S, vocab]
