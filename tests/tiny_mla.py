"""Tiny random multi-head latent attention checkpoints (DeepSeek-V3, GLM-4.7-Flash)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,  # room for sparse layouts across depth
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    max_position_embeddings=2048,
    initializer_range=0.1,  # spread logits so greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# DeepSeek-V3's features: a q LoRA, interleaved rope, YaRN with an mscale that changes
# the softmax scale (and, mscale != mscale_all_dim, cos and sin), group-limited routing,
# one dense layer first, v_head_dim != qk_nope_head_dim.
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    _COMMON,
    q_lora_rank=48,
    v_head_dim=24,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 64.0,  # max_position_embeddings / original: transformers checks it
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)
# GLM-4.7-Flash's: no q LoRA here (q_proj), rotate-half rope, one group, dense and MoE
# layers interleaved by mlp_layer_types, unnormalised top-k weights.
TINY_GLM4_MOE_LITE: dict[str, Any] = dict(
    _COMMON,
    q_lora_rank=None,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    norm_topk_prob=False,
    routed_scaling_factor=1.8,
    rope_interleave=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
MLA_KINDS = ("deepseek_v3", "glm4_moe_lite")


def build_tiny_mla(kind: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Glm4MoeLiteConfig,
        Glm4MoeLiteForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "deepseek_v3":
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY_DEEPSEEK_V3, **overrides}))
    else:
        model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**TINY_GLM4_MOE_LITE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF initialises them to 1: make each matter
                p.normal_(1.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero in HF's init
                b.normal_(0.0, 0.3)
    return model.eval()


def save_tiny_mla(kind: str, path: Path, seed: int = 0, **overrides: Any) -> str:
    from conftest import save_tiny_tokenizer

    build_tiny_mla(kind, seed, **overrides).save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)
