"""Named real-model shapes for dummy-weight benchmarks (no checkpoint download needed)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

_LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# Llama-3-8B with a 1M-token context, as gradientai/Llama-3-8B-Instruct-Gradient-1048k
# (the same layers; RoPE theta raised instead of Llama 3.1's scaling).
_LLAMA3_8B_1M: dict[str, Any] = {
    **{k: v for k, v in _LLAMA3_8B.items() if k != "rope_scaling"},
    "max_position_embeddings": 1048576,
    "rope_theta": 3580165449.0,
}
# Llama-3-70B (Llama 3.1's RoPE scaling): 141 GB of bf16 weights, more than one GPU holds.
_LLAMA3_70B: dict[str, Any] = {
    **_LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
_QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# 30.5B parameters, 3.3B activated per token: 128 experts of 768, 8 per token.
_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,  # dense layers only; there are none (mlp_only_layers=[])
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# GLM-4.7-Flash (zai-org): 31B parameters, 3B activated; multi-head latent attention
# (one 576-value latent row per token and layer) and 64 routed + 1 shared experts.
_GLM47_FLASH: dict[str, Any] = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "vocab_size": 154880,
    "hidden_size": 2048,
    "intermediate_size": 10240,  # the dense first layer
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "rope_interleave": True,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "mlp_layer_types": ["dense"] + ["sparse"] * 46,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "pad_token_id": 154820,
    "eos_token_id": [154820, 154827, 154829],
}
# Moonlight-16B-A3B (moonshotai): the DeepSeek-V3 architecture at one GPU's size (DeepSeek-
# V3 itself, 671B, needs 1.3 TB in bf16): no q LoRA, 64 routed + 2 shared experts, 6 per
# token, sigmoid routing with the correction bias, one dense layer first.
_MOONLIGHT_16B_A3B: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_interleave": True,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 50000.0,
    "attention_bias": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
}
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    "llama3-8b-1m": _LLAMA3_8B_1M,
    "llama3-70b": _LLAMA3_70B,
    "qwen3-8b": _QWEN3_8B,
    "qwen2.5-7b": _QWEN25_7B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "glm-4.7-flash": _GLM47_FLASH,
    "moonlight-16b-a3b": _MOONLIGHT_16B_A3B,
}


def write_model_config(name: str, directory: str | None = None) -> str:
    """Write the named config as `config.json` in a directory; return the directory."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r} (available: {', '.join(MODEL_CONFIGS)})")
    directory = directory or tempfile.mkdtemp(prefix=f"sparsevllm-{name}-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(MODEL_CONFIGS[name], f, indent=2)
    return directory
