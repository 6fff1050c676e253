"""Model registry keyed by the HF architecture name (config.architectures[0])."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> "module:Class"; imported lazily.
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "sparsevllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "sparsevllm.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sparsevllm.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "sparsevllm.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "sparsevllm.models.mixtral:MixtralForCausalLM",
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
