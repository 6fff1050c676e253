"""Triton kernels over the token-slot KV pool (CUDA, or CPU under TRITON_INTERPRET=1).

Importing this package imports Triton; CPU-only installs must not import it eagerly.
"""

from __future__ import annotations

from sparsevllm.attention.triton.decode import auto_num_splits, decode_attention
from sparsevllm.attention.triton.decode_mla import decode_mla_attention
from sparsevllm.attention.triton.kv_store import store_kv, store_rows
from sparsevllm.attention.triton.norm import rms_norm
from sparsevllm.attention.triton.prefill import prefill_attention, prefill_config
from sparsevllm.attention.triton.rope import apply_rope
from sparsevllm.attention.triton.scores import (
    quest_page_minmax,
    quest_page_scores,
    window_attention_mass,
)

__all__ = [
    "apply_rope",
    "auto_num_splits",
    "decode_attention",
    "decode_mla_attention",
    "prefill_attention",
    "prefill_config",
    "quest_page_minmax",
    "quest_page_scores",
    "rms_norm",
    "store_kv",
    "store_rows",
    "window_attention_mass",
]
