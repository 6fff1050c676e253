"""Model registry keyed by the HF architecture name (config.architectures[0])."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from sparsevllm.kv.layout import SlotLayout, gqa_layout

# architecture -> "module:Class"; imported lazily.
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "sparsevllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "sparsevllm.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sparsevllm.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "sparsevllm.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "sparsevllm.models.mixtral:MixtralForCausalLM",
    "DeepseekV3ForCausalLM": "sparsevllm.models.deepseek_v3:DeepseekV3ForCausalLM",
    # GLM-4.7-Flash: DeepSeek-V3's network under another config class.
    "Glm4MoeLiteForCausalLM": "sparsevllm.models.deepseek_v3:DeepseekV3ForCausalLM",
    "Gemma3ForCausalLM": "sparsevllm.models.gemma3:Gemma3ForCausalLM",
    # Multimodal Gemma 3 checkpoints (4B and up): only the language model is run.
    "Gemma3ForConditionalGeneration": "sparsevllm.models.gemma3:Gemma3ForCausalLM",
}
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class_for(config: Any) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if not archs and model_type in _MODEL_TYPES:
        archs = [_MODEL_TYPES[model_type]]
    for arch in archs:
        if arch in _MODELS:
            module, cls = _MODELS[arch].split(":")
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported model architecture {archs or model_type!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def slot_layout_of(model: nn.Module, config: Any) -> SlotLayout:
    """What one token of one layer stores: the model's own `slot_layout()` (MLA's latent
    row), else K and V per KV head of the config's attention (this rank's heads under
    tensor parallelism)."""
    own = getattr(model, "slot_layout", None)
    if own is not None:
        layout: SlotLayout = own()
        return layout
    from sparsevllm.models.llama import head_dim_of

    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    shard = getattr(model, "head_shard", None)  # a tensor-parallel rank's KV heads
    if shard is not None:
        heads = shard.num_local_kv
    return gqa_layout(heads, head_dim_of(config))
