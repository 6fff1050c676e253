"""Llama family (Llama 2/3/3.1, SmolLM2, ...), HF parameter names kept.

Qwen2 and Qwen3 reuse these modules with their differences switched on by
constructor arguments (qkv bias, q/k RMSNorm); see qwen2.py and qwen3.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.layers.linear import Projections
from sparsevllm.layers.mlp import GatedMLP
from sparsevllm.layers.norm import RMSNorm
from sparsevllm.layers.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_idx: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]  # x: [T, hidden]
        q, k, v = self.qkv(x)  # fused: strided views of one [T, (Hq + 2 Hkv) * D] GEMM
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions, q, k)
        o = batch.backend.forward(self.layer_idx, q, k, v, batch, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(GatedMLP):
    def __init__(self, config: Any, bias: bool = False) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, **attn_kwargs: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, **attn_kwargs)
        self.mlp = self.build_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (MoE families override it)."""
        return LlamaMLP(config, bias=getattr(config, "mlp_bias", False))

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        max_position: int,
        layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer,
        **attn_kwargs: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, i, **attn_kwargs) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), max_position, rope_parameters(config)
        )

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, self.rotary_emb, batch)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Causal LM head over LlamaModel; `attn_kwargs` select the Qwen variants and
    `decoder_layer` the feed-forward blocks (the MoE families)."""

    attn_kwargs: dict[str, bool] = {}
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(
            config, max_position, self.decoder_layer, **self.attn_kwargs_for(config)
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attn_kwargs_for(cls, config: Any) -> dict[str, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias}

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [S, vocab]

    def rope_frequencies(self, layer: int) -> torch.Tensor | None:
        """The RoPE angle per position of `layer`'s rotated pairs `[head_dim // 2]`."""
        return self.model.rotary_emb.inv_freq
