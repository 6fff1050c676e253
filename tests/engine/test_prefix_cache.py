"""Radix prefix cache: unit behaviour and end to end through the engine."""

from __future__ import annotations

import pytest

from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache.radix_tree import RadixTree


def test_match_split_insert_and_duplicates():
    cache = RadixTree()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == []
    slots, node = cache.match([1, 2, 9])
    assert slots == [10, 11]  # the node was split after two tokens
    # A second copy of the same prefix: the tree keeps its own slots, ours come back.
    assert cache.insert([1, 2, 5], [20, 21, 22]) == [20, 21]
    assert cache.match([1, 2, 5, 7])[0] == [10, 11, 22]
    assert cache.num_cached_slots == 5 and cache.num_evictable_slots == 5


def test_locked_nodes_are_never_evicted_and_lru_goes_first():
    cache = RadixTree()
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([7, 8], [7, 8])
    cache.insert([9], [9])
    _, node = cache.match([1, 2, 3])
    cache.lock(node)
    cache.match([9])  # touch: [7, 8] is now the least recently used
    assert cache.evict(1) == [7, 8]
    assert cache.evict(10) == [9]  # only the unlocked rest
    assert cache.num_evictable_slots == 0 and cache.num_cached_slots == 3
    cache.unlock(node)
    assert sorted(cache.evict(10)) == [1, 2, 3]


def test_split_keeps_locks_balanced():
    cache = RadixTree()
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    _, node = cache.match([1, 2, 3, 4])
    cache.lock(node)
    cache.match([1, 2, 7])  # splits the locked node
    cache.unlock(node)
    assert cache.num_evictable_slots == 4
    assert sorted(cache.evict(4)) == [1, 2, 3, 4]


def test_pruned_node_keeps_its_tokens_and_splits_by_position():
    cache = RadixTree()
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15])
    _, node = cache.match([1, 2, 3, 4, 5, 6])
    assert cache.drop_slots(node, {11, 12, 14}) == 3
    assert cache.entries() == [(6, 3)] and cache.num_cached_slots == 3
    # Matching is by tokens: a partial match splits the pruned node by token position.
    slots, node = cache.match([1, 2, 3, 4, 9])
    assert slots == [10, 13] and cache.depth(node) == 4
    assert cache.view(node) == ([10, 13], [0, 3])
    # A request that borrowed the pruned prefix: its view is the borrowed slots, then one
    # slot per later token (and an unused one, handed back).
    assert cache.adopt([1, 2, 3, 4, 9, 8], [10, 13, 20, 21, 22], node) == [22]
    assert cache.match([1, 2, 3, 4, 9, 8])[0] == [10, 13, 20, 21]
    # A request that computed the whole prefix itself: its copies are all freed.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [30, 31, 32, 33, 34, 35, 36]) == list(range(30, 36))
    assert cache.match([1, 2, 3, 4, 5, 6, 7])[0] == [10, 13, 15, 36]
    assert cache.num_cached_slots == cache.num_evictable_slots == 6
    cache.lock(node)
    with pytest.raises(RuntimeError, match="in use"):
        cache.drop_slots(node, {10})


PREFIX = [1] + [(5 * i) % 240 + 3 for i in range(499)]  # 500 tokens


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def test_shared_prefix_prefills_only_the_suffix(model):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    second = PREFIX + [77, 78, 79, 80, 81]
    plain = LLM(model, enable_prefix_caching=False, max_model_len=1024)
    ref = plain.generate([second], greedy, use_tqdm=False)[0]
    llm = LLM(model, max_model_len=1024)
    llm.generate([PREFIX + [40, 41]], greedy, use_tqdm=False)
    before = llm.stats()["num_prefill_tokens_computed"]
    out = llm.generate([second], greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 496
    assert (
        llm.stats()["num_prefill_tokens_computed"] - before == len(second) - out.num_cached_tokens
    )
    assert out.token_ids == ref.token_ids
    assert llm.stats()["num_cached_prompt_tokens"] == out.num_cached_tokens


def test_identical_prompt_reuses_all_but_the_last_token(model):
    llm = LLM(model, max_model_len=1024)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = llm.generate([PREFIX], params, use_tqdm=False)[0]
    b = llm.generate([PREFIX], params, use_tqdm=False)[0]
    assert b.num_cached_tokens == len(PREFIX) - 1 and b.token_ids == a.token_ids


def test_eviction_under_pressure_never_frees_slots_in_use(model):
    # Room for about two 500-token requests: caching the first must not starve the second,
    # and a running request's borrowed prefix must survive the eviction of others.
    llm = LLM(model, max_model_len=1024, num_kv_slots=1100, chunk_prefill_size=256)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([PREFIX], SamplingParams(max_tokens=2), use_tqdm=False)
    other = [2] + [(3 * i) % 240 + 3 for i in range(499)]
    llm.generate([other], SamplingParams(max_tokens=2), use_tqdm=False)
    # Both are cached now; a new request on PREFIX borrows it, then a third prompt
    # needs room: only the unlocked `other` may be evicted.
    engine.add_request(PREFIX + [9, 9], greedy, "borrower")
    engine.step()
    borrowed = set(engine.pool.table(engine._by_request["borrower"].seq_id)[:499])
    engine.add_request([3] + [(7 * i) % 240 + 3 for i in range(499)], greedy, "third")
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
            seq = engine._by_request.get("borrower")
            if seq is not None and engine.pool.has(seq.seq_id):
                assert set(engine.pool.table(seq.seq_id)[:499]) == borrowed
    plain = LLM(model, enable_prefix_caching=False, max_model_len=1024)
    ref = plain.generate([PREFIX + [9, 9]], greedy, use_tqdm=False)[0]
    assert outputs["borrower"].token_ids == ref.token_ids
    assert outputs["borrower"].num_cached_tokens == 500
    assert len(outputs["third"].token_ids) == 40
    assert len(engine.store.tree.match(other)[0]) < 499  # `other` was evicted for room


def test_eviction_methods_refuse_prefix_caching(model):
    with pytest.raises(ValueError, match="radix. needs storage that stays a plain prefix"):
        LLM(model, sparse_method="snapkv", prefix_cache_mode="radix")
