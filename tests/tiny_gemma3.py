"""A tiny random Gemma 3 checkpoint (sliding-window and full layers) for tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

WINDOW = 8
TINY_GEMMA3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,  # != head_dim, so a wrong scale shows
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    sliding_window=WINDOW,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
    },
    max_position_embeddings=2048,
    initializer_range=0.1,  # spread logits so greedy choices are not near-ties
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def randomize_norms(model: torch.nn.Module) -> None:
    # HF initialises Gemma norm weights to 0 (scale 1 + 0); random values make sure
    # the (1 + w) form and every norm's placement matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)


def save_tiny_gemma3(path: Path, seed: int = 0, **overrides: Any) -> str:
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY_GEMMA3, **overrides}))
    randomize_norms(model)
    model.eval().save_pretrained(path)
    return str(path)
