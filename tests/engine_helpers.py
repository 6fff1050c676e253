"""Helpers shared by the engine tests: per-method knobs for the 4-layer tiny models, and
driving one request to its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparsevllm import SamplingParams
from sparsevllm.sparse.registry import method_names

# The method x feature matrix on the 4-layer tiny models: every sparse method, prompts of
# 3 to 61 tokens, and the knobs that make every layer sparse there.
# DeltaKV needs a compressor trained for each model: its own matrix is tests/deltakv.
SPARSE_METHODS = [m for m in method_names() if m not in ("vanilla", "deltakv")]
MATRIX_PROMPTS = [
    [1] + list(range(10, 70)),
    [1] + list(range(100, 125)),
    [1, 5, 6],
    [1] + list(range(200, 241)),
]
# Head scores for the 4-layer, 2-KV-head tiny models (DuoAttention ships none for them):
# at its default sparsity layer 2 streams whole, layers 1 and 3 mix, layer 0 retrieves.
DUO_TINY_SCORES = str(Path(__file__).parent / "data" / "duoattention_4x2.json")
EVERY_LAYER_SPARSE: dict[str, dict[str, Any]] = {
    "duoattention": {"duoattention_head_scores": DUO_TINY_SCORES},
    "omnikv": {"full_attention_layers": (0, 2)},
    "quest": {"quest_skip_layers": 1},
}


def covering_budget(method: str, recent: int) -> dict[str, Any]:
    """`method` with budgets that cover the whole context (`recent` >= prompt + output):
    it must give vanilla's tokens."""
    return {
        "sparse_method": method,
        "decode_keep_tokens": 4096,
        "recent_keep_tokens": recent,
        **EVERY_LAYER_SPARSE.get(method, {}),
    }


# Small budgets that make every method evict or select within the tiny prompts of the
# engine tests (OmniKV and Quest need the 4-layer "llama4" model for their layer knobs).
METHOD_KNOBS: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "streamingllm": {"sink_keep_tokens": 4, "recent_keep_tokens": 20},
    "snapkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "pyramidkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "adakv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "duoattention": {
        "sink_keep_tokens": 2,
        "recent_keep_tokens": 6,
        "duoattention_interval": 4,
        "duoattention_head_scores": DUO_TINY_SCORES,
    },
    "knorm": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "keydiff": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    # Partitions of 8: the 61-token prompt has six scored ones.
    "lagkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 8, "lagkv_lag_size": 8},
    "strided": {"decode_keep_tokens": 24, "recent_keep_tokens": 8},
    "expected_attention": {
        "decode_keep_tokens": 24,
        "recent_keep_tokens": 8,
        "expected_attention_n_future": 16,
    },
    "kvzip": {"decode_keep_tokens": 24, "recent_keep_tokens": 8, "kvzip_chunk_size": 16},
    "h2o": {"decode_keep_tokens": 24, "recent_keep_tokens": 4, "sink_keep_tokens": 2},
    "rkv": {"decode_keep_tokens": 24, "recent_keep_tokens": 4, "rkv_interval": 8},
    "tova": {"decode_keep_tokens": 24, "recent_keep_tokens": 0, "sink_keep_tokens": 0},
    "quest": {
        "decode_keep_tokens": 16,
        "recent_keep_tokens": 4,
        "quest_chunk_size": 4,
        "quest_skip_layers": 1,
    },
    "omnikv": {"decode_keep_tokens": 16, "recent_keep_tokens": 4, "full_attention_layers": (0, 2)},
}


def run_request(
    engine: Any, prompt: list[int], params: SamplingParams, chain_id: str | None = None
) -> tuple[Any, int]:
    """Step the engine until the request ends: (its final output, tokens it prefilled)."""
    before = engine.stats()["num_prefill_tokens_computed"]
    rid = engine.add_request(prompt, params, chain_id=chain_id)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out, engine.stats()["num_prefill_tokens_computed"] - before
