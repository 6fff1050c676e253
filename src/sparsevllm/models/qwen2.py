"""Qwen2 / Qwen2.5: Llama layout with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from sparsevllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attn_kwargs_for(cls, config: Any) -> dict[str, bool]:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        return {"qkv_bias": True, "o_bias": False}
