"""The cases of the greedy-token regression recording (`record_greedy.py` writes them,
`test_greedy_recording.py` replays them): every method on two tiny models and on the
bundled default model, with budgets small enough that every method evicts or selects,
chunked prefill, and a pool small enough to preempt."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

# Small budgets: every method evicts or selects within these prompts.
TINY_KNOBS: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "streamingllm": {"sink_keep_tokens": 4, "recent_keep_tokens": 20},
    "snapkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "pyramidkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "h2o": {"decode_keep_tokens": 24, "recent_keep_tokens": 4, "sink_keep_tokens": 2},
    "tova": {"decode_keep_tokens": 24, "recent_keep_tokens": 0, "sink_keep_tokens": 0},
    "quest": {"decode_keep_tokens": 16, "recent_keep_tokens": 4, "quest_chunk_size": 4},
    "knorm": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "omnikv": {"decode_keep_tokens": 16, "recent_keep_tokens": 4},
}
# Layer layouts of the 4-layer tiny Llama (the Gemma 3 one keeps its defaults).
LLAMA4_LAYOUT = {"omnikv": {"full_attention_layers": (0, 2)}, "quest": {"quest_skip_layers": 1}}
TINY_PROMPTS = [
    [1, *range(10, 70)],
    [1, *range(100, 125)],
    [1, 5, 6],
    [1, *range(200, 241)],
]
DEFAULT_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when "
    "Johannes Gutenberg combined movable metal type, oil-based ink and a screw press. "
    "Within decades, presses spread across Europe, books became cheaper, and literacy "
    "rose in cities. Scholars could compare identical copies of texts for the first "
    "time. Summarize the main effects of the printing press in one sentence:",
    "List three prime numbers greater than one hundred and explain why each is prime. "
    "A prime number has exactly two divisors: one and itself. The first candidates "
    "above one hundred are 101, 102, 103 and so on; even numbers are never prime. Answer:",
]
ENGINE = {"chunk_prefill_size": 7, "max_num_seqs": 4}


def tiny_case_settings(kind: str, method: str) -> dict[str, Any]:
    layout = LLAMA4_LAYOUT.get(method, {}) if kind == "llama4" else {}
    return {**ENGINE, "sparse_method": method, **TINY_KNOBS[method], **layout}


def default_case_settings(method: str) -> dict[str, Any]:
    return {"chunk_prefill_size": 16, "sparse_method": method, **TINY_KNOBS[method]}


def weights_digest(model_dir: str) -> str:
    """SHA-256 of a tiny checkpoint's tensors: the recording only binds the same weights."""
    from safetensors.torch import load_file

    tensors = load_file(f"{model_dir}/model.safetensors")
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
