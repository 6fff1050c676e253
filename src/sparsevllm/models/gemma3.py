"""Gemma 3 (text), HF parameter names kept.

Differences from Llama, all following transformers' `modeling_gemma3.py`:
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype;
- RMSNorm scales by (1 + weight) in float32 (`GemmaRMSNorm`);
- four norms per layer: input, post-attention (on the attention output, before the
  residual add), pre-feed-forward and post-feed-forward;
- q_norm / k_norm over head_dim before RoPE; scale = query_pre_attn_scalar ** -0.5;
- per-layer `layer_types`: sliding layers attend to the last `sliding_window`
  positions and use the local RoPE base, full layers use the global RoPE (with its
  scaling, e.g. linear x8 on the 4B+ models);
- gelu(tanh) gated MLP, tied embeddings, optional final logit soft-capping.

Multimodal checkpoints (`Gemma3ForConditionalGeneration`, model_type "gemma3") run
their language model only: `adapt_config` picks the text config and
`remap_checkpoint` renames the text weights and drops the vision tower.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.layers.activation import get_activation
from sparsevllm.layers.linear import Projections
from sparsevllm.layers.norm import GemmaRMSNorm
from sparsevllm.layers.rotary import RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"

# Checkpoint prefixes of the language model inside multimodal checkpoints
# (transformers >= 4.52 layout first, then the original Hub layout).
_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES: tuple[str, ...] = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


def layer_types_of(config: Any) -> list[str]:
    """Per-layer attention type; old configs only carry `sliding_window_pattern`."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """RoPE parameters of one layer type.

    transformers 5 keeps one dict per layer type in `rope_parameters`; 4.x has
    `rope_theta` + `rope_scaling` for full layers and `rope_local_base_freq`
    (unscaled) for sliding layers.
    """
    nested = getattr(config, "rope_parameters", None) or {}
    if layer_type in nested:
        params = dict(nested[layer_type])
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        return params
    if layer_type == SLIDING:
        base = getattr(config, "rope_local_base_freq", None) or 10000.0
        return {"rope_type": "default", "rope_theta": base}
    return rope_parameters(config)


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = layer_types_of(config)[layer_idx]
        # None on full layers: the backend then attends causally over the whole view.
        self.sliding_window: int | None = (
            config.sliding_window if self.layer_type == SLIDING else None
        )
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        h, d, bias = config.hidden_size, self.head_dim, bool(config.attention_bias)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, config.rms_norm_eps)
        self.qkv = Projections(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]  # x: [T, hidden]
        q, k, v = self.qkv(x)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions, q, k)
        o = batch.backend.forward(
            self.layer_idx, q, k, v, batch, self.scale, window=self.sliding_window
        )  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = get_activation(config.hidden_activation)
        self.gate_up = Projections(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(self.act(gate) * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    @property
    def layer_type(self) -> str:
        return self.self_attn.layer_type

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        # Sandwich norms: each sub-block's output is normalised before the residual add.
        attn = self.self_attn(self.input_layernorm(x), rotary, batch)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3TextModel(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.hidden_size = config.hidden_size
        self.rebuild_buffers()
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # One RoPE table per layer type present: local base on sliding layers, the
        # global (possibly scaled) base on full ones.
        self.rotary_emb = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    config.head_dim, max_position, gemma3_rope_parameters(config, kind)
                )
                for kind in sorted(set(layer_types_of(config)))
            }
        )

    def rebuild_buffers(self) -> None:
        """The embedding scale, on the default device (models/loader.py)."""
        # HF multiplies by sqrt(hidden) cast to the weight dtype (25.30 -> 25.25 in bf16),
        # so the scale is kept in float32 here and cast at use, not precomputed exactly.
        scale = torch.tensor(self.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        x = x * self.embed_scale.to(x.dtype)
        for layer in self.layers:
            x = layer(x, self.rotary_emb[layer.layer_type], batch)
        return self.norm(x)  # [T, hidden]


class Gemma3ForCausalLM(nn.Module):
    """Causal LM head over Gemma3TextModel (the embedding matrix, tied by default)."""

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        config = self.adapt_config(config)
        self.check_config(config)
        self.config = config
        self.model = Gemma3TextModel(config, max_position)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_logit_softcapping: float | None = getattr(
            config, "final_logit_softcapping", None
        )

    @staticmethod
    def adapt_config(config: Any) -> Any:
        """The text config of a multimodal Gemma 3 config (itself otherwise).

        Runs before the engine reads sizes (layers, heads, vocab) off the config.
        """
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        text.architectures = ["Gemma3ForCausalLM"]
        # Multimodal configs keep tying (and sometimes the EOS ids) on the outer config.
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        if getattr(text, "eos_token_id", None) is None:
            text.eos_token_id = getattr(config, "eos_token_id", None)
        return text

    @staticmethod
    def check_config(config: Any) -> None:
        """Reject variants whose semantics this implementation does not reproduce."""
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is not supported")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            # HF itself refuses it under SDPA (eager only); our backends run SDPA-style
            # kernels with no hook for a tanh on the scores.
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")

    @staticmethod
    def remap_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rename a multimodal checkpoint's language-model tensors; drop vision ones."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            if name.startswith(_VISION_PREFIXES):
                continue
            for old, new in _TEXT_PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            out[name] = tensor
        return out

    def sliding_window_layers(self) -> list[tuple[int, int]]:
        """(layer_idx, window) of every sliding-window layer.

        Such a layer never reads more than its last `window` positions, so the
        KV pool only needs to keep that many entries for it.
        """
        return [
            (i, layer.self_attn.sliding_window)
            for i, layer in enumerate(self.model.layers)
            if layer.self_attn.sliding_window is not None
        ]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def rope_frequencies(self, layer: int) -> torch.Tensor | None:
        """The RoPE angle per position of `layer`'s rotated pairs `[head_dim // 2]` (its
        layer type's table: local on sliding layers, global on full ones)."""
        kind = self.model.layers[layer].layer_type
        return self.model.rotary_emb[kind].inv_freq

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [S, vocab]
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
