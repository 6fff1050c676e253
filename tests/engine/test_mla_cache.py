"""Cross-request state over MLA's latent rows (tiny DeepSeek-V3): the radix cache, the
chain cache with an evicting method, the disk tier and pruning move and score latent
rows through the same slot interface as per-head K/V."""

from __future__ import annotations

import pytest

from engine_helpers import run_request
from sparsevllm import LLM, SamplingParams
from tiny_mla import save_tiny_mla

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HISTORY = [1] + [(5 * i) % 240 + 3 for i in range(99)]  # 100 tokens
NEW = [9, 8, 7, 6]
CHAIN = dict(sparse_method="snapkv", decode_keep_tokens=1024, max_model_len=512)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_mla("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


def second_turn(llm: LLM, prune: dict | None = None) -> tuple[list[int], int, int]:
    """Two turns; (second answer, its cached tokens, tokens it prefilled)."""
    first, _ = run_request(llm.engine, HISTORY, GREEDY)
    if prune is not None:
        target = {"chain_id": first.chain_id} if first.chain_id else {"prompt": HISTORY}
        llm.prune(**target, **prune)
    out, prefilled = run_request(llm.engine, HISTORY + first.token_ids + NEW, GREEDY)
    return out.token_ids, out.num_cached_tokens, prefilled


@pytest.fixture(scope="module")
def uncached(model) -> list[int]:
    llm = LLM(model, enable_prefix_caching=False, max_model_len=512)
    first, _ = run_request(llm.engine, HISTORY, GREEDY)
    out, _ = run_request(llm.engine, HISTORY + first.token_ids + NEW, GREEDY)
    return out.token_ids


@pytest.mark.parametrize("settings", [dict(max_model_len=512), CHAIN], ids=["radix", "chain"])
def test_a_cached_history_gives_the_uncached_tokens(model, uncached, settings):
    tokens, cached, prefilled = second_turn(LLM(model, **settings))
    assert tokens == uncached
    assert cached == len(HISTORY) + GREEDY.max_tokens - 1 and prefilled == len(NEW) + 1


def test_a_chain_restored_from_disk_gives_the_same_tokens(model, uncached, tmp_path):
    settings = dict(CHAIN, disk_offload_dir=str(tmp_path))
    llm = LLM(model, **settings)
    first, _ = run_request(llm.engine, HISTORY, GREEDY)
    llm.close()  # the idle chain's latent rows go to disk
    again = LLM(model, **settings)
    out, prefilled = run_request(again.engine, HISTORY + first.token_ids + NEW, GREEDY)
    assert out.token_ids == uncached and prefilled == len(NEW) + 1


@pytest.mark.parametrize("settings", [dict(max_model_len=512), CHAIN], ids=["radix", "chain"])
def test_pruning_scores_latent_rows_and_refuses_a_scorer_that_cannot(model, settings):
    llm = LLM(model, **settings)
    first, _ = run_request(llm.engine, HISTORY, GREEDY)
    target = {"chain_id": first.chain_id} if first.chain_id else {"prompt": HISTORY}
    with pytest.raises(ValueError, match="knorm.*mla_latent.*RMS-normalised"):
        llm.prune(**target, ranges=[(20, 60)], method="knorm", keep_ratio=0.25)
    result = llm.prune(**target, ranges=[(20, 60)], method="keydiff", keep_ratio=0.25)
    assert result.slots_freed == 30
    out, prefilled = run_request(llm.engine, HISTORY + first.token_ids + NEW, GREEDY)
    assert prefilled == len(NEW) + 1 and len(out.token_ids) == GREEDY.max_tokens
