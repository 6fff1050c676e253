"""CPU offload tier of the radix prefix cache, end to end through the engine.

Under pool pressure a cached prefix moves to host memory instead of being dropped; the
next request with that prefix restores it (all of it counts as cached), with KV rows
bit-identical to before and the same greedy output as without pressure.
"""

from __future__ import annotations

import pytest

from radix_offload_helpers import (
    FIRST,
    GREEDY,
    NEW,
    PRESSURE,
    borrowed_rows,
    cached_rows,
    other,
    run_one,
    same_rows,
    squeeze,
)
from sparsevllm import LLM, SamplingParams
from sparsevllm.server.cache import cache_listing
from tiny_gemma3 import save_tiny_gemma3


@pytest.fixture(scope="module", params=["llama4", "gemma3"])
def model(request, tiny_model_factory, tmp_path_factory):
    # Gemma 3: under radix caching the sliding-window layers sit in the single pool
    # group with full history; their rows travel with the node like the others.
    if request.param == "gemma3":
        return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    return tiny_model_factory(request.param)


def test_an_offloaded_prefix_comes_back_bit_exactly(model):
    calm_llm = LLM(model, max_model_len=1024)
    first = run_one(calm_llm, FIRST)
    follow = FIRST + first.token_ids + NEW
    calm = run_one(calm_llm, follow)
    history = len(FIRST) + len(first.token_ids) - 1
    assert calm.num_cached_tokens == history

    llm = LLM(model, **PRESSURE, cpu_offload_gb=0.5)
    assert run_one(llm, FIRST).token_ids == first.token_ids
    saved, _ = cached_rows(llm, follow)
    squeeze(llm)
    cache, tiers = llm.engine.store.tree, llm.engine.store.tiers
    listed = llm.engine.store.tiering.listing()
    assert [(r["tier"], r["start"], r["logical_tokens"]) for r in listed] == [("CPU", 0, history)]
    assert listed[0]["bytes"] == history * llm.engine.runner.kv_bytes_per_slot
    assert tiers.cpu.used_bytes == listed[0]["bytes"]
    assert cache.num_cached_slots == 3 * history  # the squeezing prompts, all resident

    rid = llm.engine.add_request(follow, GREEDY)
    llm.engine.step()
    assert same_rows(borrowed_rows(llm, rid, history), saved)
    out = None
    while llm.engine.has_unfinished_requests():
        out = next((o for o in llm.engine.step() if o.request_id == rid and o.finished), out)
    assert out.num_cached_tokens == history  # all of it, restored
    assert out.token_ids == calm.token_ids
    stats = llm.stats()
    assert stats["num_kv_restored"] == 1 and stats["num_kv_offloaded"] >= 2
    assert stats["num_preemptions"] == 0


def test_a_locked_prefix_is_never_offloaded(model):
    llm = LLM(model, **PRESSURE, cpu_offload_gb=0.5)
    engine = llm.engine
    run_one(llm, FIRST, SamplingParams(max_tokens=2))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request(FIRST + [9, 9], long, "borrower")
    engine.step()
    seq = engine._by_request["borrower"]
    borrowed = engine.pool.table(seq.seq_id)[: len(FIRST)]
    path = engine.store.tree.path(engine.store.borrowed_node(seq.seq_id))
    for j in range(4):  # more than the pool holds beside the borrower
        engine.add_request(other(j), GREEDY, f"other-{j}")
    while engine.has_unfinished_requests():
        engine.step()
        if engine.pool.has(seq.seq_id):
            assert engine.pool.table(seq.seq_id)[: len(FIRST)] == borrowed
            assert all(node.tier is None for node in path)
    assert engine.store.tiers.num_offloaded >= 1
    ref = run_one(LLM(model, enable_prefix_caching=False, max_model_len=1024), FIRST + [9, 9], long)
    out = run_one(llm, FIRST + [9, 9], long)  # the prefix is cached (now at full length)
    assert out.num_cached_tokens == len(FIRST) + 1 and out.token_ids == ref.token_ids


def test_the_byte_cap_holds_and_the_oldest_entries_are_dropped(model):
    probe = LLM(model, **PRESSURE)
    node_bytes = 209 * probe.engine.runner.kv_bytes_per_slot
    cap = 1.5 * node_bytes
    llm = LLM(model, **PRESSURE, cpu_offload_gb=cap / 2**30)
    engine = llm.engine
    for j in range(7):
        rid = engine.add_request(other(j), GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
            assert engine.store.tiers.cpu.used_bytes <= engine.store.tiers.cpu.capacity_bytes
        assert engine.stats()["kv_offload_cpu_bytes"] == engine.store.tiers.cpu.used_bytes
    del rid
    # Three prefixes stay resident, the newest offloaded one is on the CPU (the cap holds
    # one), the older ones left the tree.
    listed = engine.store.tiering.listing()
    assert [r["tier"] for r in listed] == [
        "CPU"
    ] and engine.store.tiers.cpu.used_bytes == node_bytes
    assert len(engine.store.tree.entries()) == 4
    assert engine.store.tree.match(other(0))[0] == []  # dropped: nothing cached
    out = run_one(llm, other(3) + NEW)  # the CPU one is other(3): restored
    assert out.num_cached_tokens == 200


def test_listing_and_stats_show_offloaded_nodes(model):
    llm = LLM(model, **PRESSURE, cpu_offload_gb=0.5)
    run_one(llm, FIRST)
    run_one(llm, FIRST[:100] + [4, 4, 4])  # splits the cached prefix after 100 tokens
    squeeze(llm)
    listing = cache_listing(llm.engine)
    assert listing["mode"] == "radix"
    spans = [
        (r["tier"], r["start"], r["logical_tokens"], r["tokens"]) for r in listing["offloaded"]
    ]
    assert spans == [("CPU", 0, 100, 100), ("CPU", 100, 112, 12), ("CPU", 100, 209, 109)]
    offload = listing["offload"]
    assert offload["cpu_bytes"] == sum(r["bytes"] for r in listing["offloaded"])
    assert offload["num_offloaded"] == 3 and offload["num_restored"] == 0
    # The leaves of the tree are listed with what stays resident of their paths.
    offloaded = [p["logical_tokens"] for p in listing["prefixes"] if p["resident_slots"] == 0]
    assert sorted(offloaded) == [112, 209]


def test_a_request_that_cannot_be_admitted_does_not_restore_its_prefix(model):
    """A restore the admission check would undo is not done: the running batch would
    evict the restored node again, and the next step restore it again."""
    calm_llm = LLM(model, max_model_len=1024)
    first = run_one(calm_llm, FIRST)
    follow = FIRST + first.token_ids + NEW
    calm = run_one(calm_llm, follow)
    llm = LLM(model, **PRESSURE, cpu_offload_gb=0.5)
    engine = llm.engine
    run_one(llm, FIRST)
    squeeze(llm)  # FIRST is on the CPU; three other prefixes are resident
    engine.add_request(other(3), SamplingParams(max_tokens=300, ignore_eos=True), "long")
    while engine.pool.num_available > 210:  # the long request grows one slot a step
        engine.step()
    # FIRST's 209 rows would fit, but not with a slot for the follow-up and the runner.
    rid = engine.add_request(follow, GREEDY)
    out = None
    while engine.has_unfinished_requests():
        if "long" in engine._by_request:
            assert engine.store.tiers.num_restored == 0
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    assert engine.store.tiers.num_restored == 1
    assert out.num_cached_tokens == len(follow) - len(NEW) - 1
    assert out.token_ids == calm.token_ids
