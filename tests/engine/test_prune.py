"""Pruning cached history (LLM.prune): radix prefixes and idle chains."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache.store import CacheEntryNotFound, ChainBusyError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HISTORY = [1] + [(5 * i) % 240 + 3 for i in range(199)]  # 200 tokens
NEW = [9, 8, 7, 6]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def turn(llm: LLM, prompt: list[int], chain_id: str | None = None):
    """One request; returns its output and how many tokens it prefilled."""
    return run_request(llm.engine, prompt, GREEDY, chain_id)


def two_turns(llm: LLM, prune: dict | None, chain_id: str | None = None):
    first, _ = turn(llm, HISTORY, chain_id)
    result = None
    if prune is not None:
        target = {"chain_id": first.chain_id} if first.chain_id else {"prompt": HISTORY}
        result = llm.prune(**target, **prune)
    history = HISTORY + first.token_ids
    second, prefilled = turn(llm, history + NEW, chain_id)
    return first, result, second, prefilled, len(history) - 1


CONFIGS = {
    "radix": dict(max_model_len=1024),
    "chain": dict(max_model_len=1024, sparse_method="knorm", decode_keep_tokens=1024),
}


@pytest.mark.parametrize("kind", ["radix", "chain"])
@pytest.mark.parametrize(
    "method", ["knorm", "snapkv", "streamingllm", "keydiff", "lagkv", "strided", "kvzip"]
)
def test_pruned_history_frees_slots_and_the_next_turn_still_hits(model, kind, method):
    llm = LLM(model, **CONFIGS[kind])
    cached_before = None

    def prune_and_measure(**kwargs):
        nonlocal cached_before
        cached_before = llm.stats()["kv_slots_cached"]
        return llm.prune(**kwargs)

    first, _ = turn(llm, HISTORY)
    target = {"chain_id": first.chain_id} if kind == "chain" else {"prompt": HISTORY}
    spec = dict(ranges=[(120, 180), (20, 60)], method=method, keep_ratio=0.25)
    result = prune_and_measure(**target, **spec)
    # Each range keeps ceil(0.25 x its length): 60 -> 15 and 40 -> 10.
    assert result.slots_freed == 45 + 30
    assert llm.stats()["kv_slots_cached"] == cached_before - 75
    assert result.ranges == [(20, 60), (120, 180)]
    history = HISTORY + first.token_ids
    second, prefilled = turn(llm, history + NEW)
    # The whole logical history is reused; only the last answer token and NEW are prefilled.
    assert second.num_cached_tokens == len(history) - 1
    assert prefilled == len(NEW) + 1
    assert len(second.token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("kind", ["radix", "chain"])
def test_keep_ratio_one_changes_nothing(model, kind):
    plain = two_turns(LLM(model, **CONFIGS[kind]), None)
    kept = two_turns(LLM(model, **CONFIGS[kind]), dict(ranges=[(10, 190)], keep_ratio=1.0))
    assert kept[1].slots_freed == 0
    assert kept[2].token_ids == plain[2].token_ids
    assert kept[2].num_cached_tokens == plain[2].num_cached_tokens == kept[4]


def test_radix_listing_shows_logical_and_resident_tokens(model):
    llm = LLM(model, max_model_len=1024)
    first, _ = turn(llm, HISTORY)
    llm.prune(prompt=HISTORY, ranges=[(0, 100)], keep_ratio=0.5)
    logical = len(HISTORY) + len(first.token_ids) - 1
    assert llm.engine.store.tree.entries() == [(logical, logical - 50)]
    # A prompt that shares only part of the pruned prefix reuses that part.
    out, prefilled = turn(llm, HISTORY[:150] + [4, 4, 4])
    assert out.num_cached_tokens == 150 and prefilled == 3
    # Pruning a prefix that a second conversation extends prunes it for both.
    result = llm.prune(prompt=HISTORY[:150], ranges=[(100, 150)], keep_ratio=0.2)
    assert result.logical_tokens == 150 and result.slots_freed == 40


def test_logical_ranges_survive_per_head_eviction(model):
    """After SnapKV kept different tokens per head, a range still means the history's
    tokens: every dropped key is a key of a token inside the range."""
    kw = dict(max_model_len=1024, decode_keep_tokens=64, recent_keep_tokens=8)
    llm = LLM(model, sparse_method="snapkv", **kw)
    first, _ = turn(llm, HISTORY, chain_id="c")
    # Layer 0 keys depend only on the token and its position: a dense run gives them all.
    dense = LLM(model, max_model_len=1024, enable_prefix_caching=False)
    turn(dense, HISTORY)
    k0 = dense.engine.runner.kv_storage[0].k[: len(HISTORY)]  # [200, Hkv, D], slots 0..199
    before = _layer0_keys(llm)
    result = llm.prune("c", ranges=[(60, 200)], keep_ratio=0.5, method="knorm")
    after = _layer0_keys(llm)
    assert result.slots_freed > 0
    for h in range(k0.shape[1]):
        gone = [k for k in before[h] if not any(torch.equal(k, a) for a in after[h])]
        assert len(gone) == len(before[h]) - len(after[h]) > 0
        for k in gone:
            pos = [p for p in range(len(HISTORY)) if torch.equal(k0[p, h], k)]
            assert pos and 60 <= pos[0] < 200
    out, prefilled = turn(llm, HISTORY + first.token_ids + NEW, chain_id="c")
    assert out.chain_status == "continued" and prefilled == len(NEW) + 1


def _layer0_keys(llm: LLM) -> list[list[torch.Tensor]]:
    engine = llm.engine
    owner = engine.store.chains.chains["c"].owner
    table = engine.pool.table(owner, engine.pool.group_of_layer[0])
    keys = engine.runner.kv_storage[0].k[torch.tensor(table)]  # [L, Hkv, D]
    return [[keys[j, h].clone() for j in range(keys.shape[0])] for h in range(keys.shape[1])]


@pytest.mark.parametrize(
    "method_kw",
    [
        dict(sparse_method="h2o", h2o_decode_budget=64, recent_keep_tokens=8),
        dict(sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=100),
        dict(sparse_method="tova", decode_keep_tokens=64),
    ],
)
def test_compressed_chains_prune_and_continue(model, method_kw):
    llm = LLM(model, max_model_len=1024, **method_kw)
    first, result, second, prefilled, _ = two_turns(
        llm, dict(ranges=[(150, 200)], keep_ratio=0.5, method="snapkv"), chain_id="c"
    )
    assert result.resident_after <= result.resident_before
    assert second.chain_status == "continued" and prefilled == len(NEW) + 1
    assert len(second.token_ids) == GREEDY.max_tokens


def test_streamingllm_range_already_evicted_frees_nothing(model):
    llm = LLM(model, max_model_len=1024, sparse_method="streamingllm", recent_keep_tokens=100)
    turn(llm, HISTORY, chain_id="c")
    # Resident: tokens 0-3 and the last 100 of 207 (107-206).
    assert llm.prune("c", ranges=[(10, 100)], keep_ratio=0.1).slots_freed == 0
    assert llm.prune("c", ranges=[(100, 120)], keep_ratio=0.5).slots_freed == 6  # 13 -> 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ranges=[(5, 5)], keep_ratio=0.5), "0 <= start < end"),
        (dict(ranges=[(-1, 5)], keep_ratio=0.5), "0 <= start < end"),
        (dict(ranges=[(0, 10), (5, 20)], keep_ratio=0.5), "must not overlap"),
        (dict(ranges=[(0, 500)], keep_ratio=0.5), r"ends past the \d+ cached tokens"),
        (dict(ranges=[], keep_ratio=0.5), "non-empty"),
        (dict(ranges=[(0, 1.5)], keep_ratio=0.5), "pairs of integers"),
        (dict(ranges=[(0, 10)], keep_ratio=0.0), r"keep_ratio must be in \(0, 1\]"),
        (dict(ranges=[(0, 10)], keep_ratio=1.5), r"keep_ratio must be in \(0, 1\]"),
        (dict(ranges=[(0, 10)], keep_ratio=True), "keep_ratio must be a number"),
        (dict(ranges=[(0, 10)], keep_ratio=0.5, method="h2o"), "method must be one of"),
    ],
)
def test_bad_arguments(model, kwargs, message):
    llm = LLM(model, max_model_len=1024)
    turn(llm, HISTORY)
    with pytest.raises(ValueError, match=message):
        llm.prune(prompt=HISTORY, **kwargs)


def test_targets_not_found_busy_and_mode_errors(model):
    radix = LLM(model, max_model_len=1024)
    with pytest.raises(CacheEntryNotFound, match="no cached prefix"):
        radix.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5)
    with pytest.raises(ValueError, match="exactly one of chain_id and prompt"):
        radix.prune(ranges=[(0, 10)], keep_ratio=0.5)
    with pytest.raises(ValueError, match="radix prefix cache, which has no chains"):
        radix.prune("chain-1", ranges=[(0, 10)], keep_ratio=0.5)
    turn(radix, HISTORY)
    engine = radix.engine
    engine.add_request(HISTORY + NEW, GREEDY, "reader")
    engine.step()  # the reader borrows the cached prefix
    with pytest.raises(ChainBusyError, match="in use by a running request"):
        radix.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5)
    while engine.has_unfinished_requests():
        engine.step()
    assert radix.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5).slots_freed == 5

    chains = LLM(model, **CONFIGS["chain"])
    with pytest.raises(CacheEntryNotFound, match="no chain 'nope'"):
        chains.prune("nope", ranges=[(0, 10)], keep_ratio=0.5)
    with pytest.raises(CacheEntryNotFound, match="no chain's history"):
        chains.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5)
    first, _ = turn(chains, HISTORY, chain_id="a")
    turn(chains, HISTORY[:100] + [7, 7], chain_id="b")
    with pytest.raises(ValueError, match="2 chains match these tokens"):
        chains.prune(prompt=HISTORY[:50], ranges=[(0, 10)], keep_ratio=0.5)
    assert chains.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5).chain_id == "a"
    chains.engine.add_request(HISTORY + first.token_ids + NEW, GREEDY, chain_id="a")
    with pytest.raises(ChainBusyError, match="busy"):
        chains.prune("a", ranges=[(0, 10)], keep_ratio=0.5)
    off = LLM(model, max_model_len=1024, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is off"):
        off.prune(prompt=HISTORY, ranges=[(0, 10)], keep_ratio=0.5)
