"""Sparse prefill (prefill_sparse_method) in the engine, on the torch reference backend:
covering budgets give dense prefill's tokens, short views stay dense, small budgets skip
key blocks, and it combines with a sparse decode method."""

from __future__ import annotations

import pytest

from sparsevllm import LLM, SamplingParams
from sparsevllm.attention import sparse_prefill, torch_ref

PROMPT = [1] + [(53 * i + 7) % 240 + 3 for i in range(700)]  # 701 tokens: 11 key blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SPARSE = dict(prefill_sparse_method="vertical_slash", prefill_sparse_min_len=256)
COVERING = dict(SPARSE, prefill_sparse_vertical_blocks=64, prefill_sparse_slash_blocks=64)
SMALL = dict(SPARSE, prefill_sparse_vertical_blocks=1, prefill_sparse_slash_blocks=0)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def dense_tokens(model) -> list[int]:
    return LLM(model).generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids


@pytest.fixture
def sparse_calls(monkeypatch) -> list[int]:
    """The chunk lengths that went through sparse prefill."""
    calls: list[int] = []
    original = torch_ref.TorchRefBackend._attend_sparse

    def spy(self, q, k, v, scale):
        calls.append(q.shape[0])
        return original(self, q, k, v, scale)

    monkeypatch.setattr(torch_ref.TorchRefBackend, "_attend_sparse", spy)
    return calls


def generate(model: str, **knobs) -> list[int]:
    return LLM(model, **knobs).generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("chunk", [2048, 256])
def test_covering_selection_gives_dense_tokens(model, dense_tokens, sparse_calls, chunk):
    assert generate(model, chunk_prefill_size=chunk, **COVERING) == dense_tokens
    # Every layer of every chunk (each view is >= min_len 256, the first one's too).
    assert sparse_calls == ([701] * 4 if chunk == 2048 else [256] * 8 + [189] * 4)


def test_short_views_take_the_dense_path(model, dense_tokens, sparse_calls):
    assert generate(model, **dict(SMALL, prefill_sparse_min_len=1024)) == dense_tokens
    assert sparse_calls == []


def test_chunks_no_longer_than_last_q_stay_dense(model, sparse_calls):
    generate(model, chunk_prefill_size=64, **SMALL)
    assert sparse_calls == []


def test_small_budget_skips_blocks(model, sparse_calls, monkeypatch):
    densities = []
    select = torch_ref.estimate_reference

    def spy(q, k, scale, cfg):
        count, index = select(q, k, scale, cfg)
        densities.append(sparse_prefill.density(count, q.shape[0], k.shape[0], cfg))
        return count, index

    monkeypatch.setattr(torch_ref, "estimate_reference", spy)
    assert len(generate(model, **SMALL)) == 6
    assert sparse_calls == [701] * 4 and all(d < 0.6 for d in densities)


def test_combines_with_snapkv_decode(model, sparse_calls):
    knobs = dict(SMALL, sparse_method="snapkv", decode_keep_tokens=48, recent_keep_tokens=8)
    llm = LLM(model, **knobs)
    engine = llm.engine
    budgets = [engine.method.layer_budget(layer) for layer in range(4)]
    engine.add_request(PROMPT, GREEDY)
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.pool.used_per_layer())
    assert sparse_calls == [701] * 4
    assert used[0] == budgets  # the prompt's KV cut to the budget after its prefill
    assert used[-1] == [b + 5 for b in budgets]


def test_quantized_kv_stays_dense(model, sparse_calls):
    generate(model, kv_cache_dtype="int8", **SMALL)
    assert sparse_calls == []


def test_only_full_attention_layers_go_sparse(tmp_path, sparse_calls):
    from tiny_gemma3 import save_tiny_gemma3

    gemma = save_tiny_gemma3(tmp_path / "gemma3")  # layers: sliding, full, sliding, full
    covering = LLM(gemma, **COVERING).generate([PROMPT], GREEDY, use_tqdm=False)
    assert sparse_calls == [701, 701]  # the two full-attention layers only
    dense = LLM(gemma).generate([PROMPT], GREEDY, use_tqdm=False)
    assert covering[0].token_ids == dense[0].token_ids
