"""Every sparse method on the mixture-of-experts family (Qwen3-MoE): with budgets that
cover the context each gives vanilla's tokens, also with chunked prefill and preemption.

The MoE block changes the feed-forward only; the KV cache, and so what a method keeps,
is the attention's. These tests check that the methods run unchanged on a model whose
layers mix MoE and dense feed-forward blocks.
"""

from __future__ import annotations

import pytest

from engine_helpers import MATRIX_PROMPTS, SPARSE_METHODS, covering_budget
from sparsevllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SPARSE = SPARSE_METHODS
PROMPTS = MATRIX_PROMPTS


def big_budget(method: str) -> dict:
    return covering_budget(method, recent=128)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def vanilla_tokens(model):
    return [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", SPARSE)
def test_budget_above_context_reproduces_vanilla(model, vanilla_tokens, method):
    llm = LLM(model, num_kv_slots=110, chunk_prefill_size=7, **big_budget(method))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == vanilla_tokens
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_slots_used"] == stats["kv_slots_cached"]


def test_small_budget_keeps_fewer_slots(model):
    """A budget below the context really evicts on the MoE model (SnapKV: 24 slots)."""
    llm = LLM(model, sparse_method="snapkv", decode_keep_tokens=24, recent_keep_tokens=8)
    llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.stats()["kv_slots_used_per_layer"] == [24] * 4
