"""Qwen3 (dense): Llama layout with RMSNorm on each head's q and k before RoPE."""

from __future__ import annotations

from typing import Any

from sparsevllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attn_kwargs_for(cls, config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen3 with use_sliding_window=True is not supported")
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
