"""Chain cache: eviction methods continue a conversation from their resident state."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache.store import ChainBusyError
from store_harness import Engine, World
from tiny_gemma3 import save_tiny_gemma3

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TURN1 = [1] + [(11 * i) % 240 + 3 for i in range(60)]
NEW = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]]


def run_one(engine, prompt, chain_id=None):
    return run_request(engine, prompt, GREEDY, chain_id)


def conversation(engine, chain_id=None):
    prompt, turns = list(TURN1), []
    for i in range(4):
        out, prefilled = run_one(engine, prompt, chain_id)
        turns.append((out, prefilled, list(prompt)))
        if i < 3:
            prompt = prompt + out.token_ids + NEW[i]
    return turns


@pytest.fixture(scope="module", params=["llama4", "gemma3"])
def model(request, tiny_model_factory, tmp_path_factory):
    # Gemma 3: sliding-window layers keep only their window in a pool group of their own;
    # chains, reclaim and offload must carry that group along.
    if request.param == "gemma3":
        return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    return tiny_model_factory(request.param)


def test_large_budget_chain_equals_vanilla_recompute(model):
    vanilla = LLM(model, enable_prefix_caching=False)
    ref = conversation(vanilla.engine)
    llm = LLM(model, sparse_method="snapkv", decode_keep_tokens=4096, recent_keep_tokens=64)
    turns = conversation(llm.engine)
    for (out, _, _), (ref_out, _, _) in zip(turns, ref):
        assert out.token_ids == ref_out.token_ids
    # Turns 2-4 prefill only what is new: the last answer token and the new user tokens.
    for i, (out, prefilled, prompt) in enumerate(turns[1:]):
        assert out.chain_status == "continued"
        assert out.num_cached_tokens == len(turns[i][2]) + len(turns[i][0].token_ids) - 1
        assert prefilled == len(prompt) - out.num_cached_tokens == len(NEW[i]) + 1
    assert turns[0][0].chain_status == "new"


def test_small_budget_stays_within_budget_across_turns(model):
    budget = 24
    llm = LLM(
        model,
        sparse_method="snapkv",
        decode_keep_tokens=budget,
        sink_keep_tokens=2,
        recent_keep_tokens=6,
    )
    engine = llm.engine
    turns = conversation(engine)
    for i, (out, prefilled, _) in enumerate(turns[1:]):
        assert prefilled == len(NEW[i]) + 1 and out.chain_status == "continued"
    # Between turns the idle chain holds at most budget + the tokens generated since.
    assert max(engine.pool.used_per_layer()) <= budget + GREEDY.max_tokens
    assert engine.stats()["num_idle_chains"] == 1


def test_explicit_chain_id_divergence_busy_and_not_found(model):
    llm = LLM(model, sparse_method="streamingllm", sink_keep_tokens=4, recent_keep_tokens=28)
    engine = llm.engine
    out, _ = run_one(engine, TURN1, chain_id="conv-a")
    assert out.chain_id == "conv-a" and out.chain_status == "not_found"
    follow = TURN1 + out.token_ids + [9, 9]
    # One writer per chain: a second request on a busy chain is refused.
    engine.add_request(follow, GREEDY, chain_id="conv-a")
    with pytest.raises(ChainBusyError, match="busy"):
        engine.add_request(follow, GREEDY, chain_id="conv-a")
    while engine.has_unfinished_requests():
        engine.step()
    # A request that does not extend the chain drops it and starts fresh.
    other = [1, 2, 3] + TURN1[3:]
    out, prefilled = run_one(engine, other, chain_id="conv-a")
    assert out.chain_status.startswith("diverged") and "token 1" in out.chain_status
    assert prefilled == len(other)
    out, _ = run_one(engine, TURN1, chain_id="never-seen")
    assert out.chain_status == "not_found" and out.chain_id == "never-seen"


def test_idle_chains_are_reclaimed_under_pressure(model):
    llm = LLM(
        model,
        sparse_method="snapkv",
        decode_keep_tokens=64,
        recent_keep_tokens=8,
        num_kv_slots=300,
        chunk_prefill_size=256,
    )
    engine = llm.engine
    for k in range(6):  # each idle chain keeps ~64 + 10 slots: six do not fit beside a prompt
        prompt = [1] + [(k * 13 + i) % 240 + 3 for i in range(200)]
        out, prefilled = run_one(engine, prompt)
        assert len(out.token_ids) == 10 and prefilled == len(prompt)
    stats = engine.stats()
    assert stats["num_idle_chains"] < 6 and stats["num_preemptions"] == 0
    assert stats["kv_slots_peak"] <= 300


def test_prefix_cache_mode_checks(model):
    with pytest.raises(ValueError, match="'chain' is for eviction methods"):
        LLM(model, prefix_cache_mode="chain")
    llm = LLM(model, sparse_method="snapkv", enable_prefix_caching=False)
    out, _ = run_one(llm.engine, TURN1)
    assert out.chain_id is None and llm.stats()["num_idle_chains"] == 0


def test_cpu_offload_restores_identical_kv_and_output(model):
    """Under pressure an idle chain moves to the CPU tier and comes back bit-exactly."""
    kw = dict(
        sparse_method="snapkv",
        decode_keep_tokens=64,
        recent_keep_tokens=8,
        num_kv_slots=300,
        chunk_prefill_size=256,
    )
    first = [1] + [(5 * i) % 240 + 3 for i in range(200)]

    def turn_two(llm, pressure: bool):
        engine = llm.engine
        out, _ = run_one(engine, first, chain_id="keep")
        owner = engine.store.chains.chains["keep"].owner
        saved = [(k[t].clone(), v[t].clone()) for k, v, t in _views(engine, owner)]
        if pressure:  # other conversations need the room
            for j in range(3):
                run_one(engine, [2] + [(7 * i + j) % 240 + 3 for i in range(200)])
            assert engine.store.chains.chains["keep"].offloaded
            assert not engine.pool.has(owner)
        follow = first + out.token_ids + [9, 8, 7]
        rid = engine.add_request(follow, GREEDY, chain_id="keep")
        restored = [(k[t], v[t]) for k, v, t in _views(engine, owner)]
        for (k0, v0), (k1, v1) in zip(saved, restored):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        result = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    result = o
        return result

    calm = turn_two(LLM(model, **kw, cpu_offload_gb=0.0), pressure=False)
    llm = LLM(model, **kw, cpu_offload_gb=0.5)
    squeezed = turn_two(llm, pressure=True)
    assert squeezed.chain_status == "continued (restored from CPU)"
    assert squeezed.token_ids == calm.token_ids
    assert llm.engine.store.tiers.num_offloaded >= 1 and llm.engine.store.tiers.num_restored == 1


def _views(engine, owner):
    runner, pool = engine.runner, engine.pool
    for layer in range(runner.num_layers):
        table = torch.tensor(pool.table(owner, pool.group_of_layer[layer]))
        yield runner.kv_storage[layer].k, runner.kv_storage[layer].v, table


def test_an_aborted_request_leaves_the_chain_another_request_parked_under_its_id():
    """Two requests name an unknown chain; the first to finish parks it. Aborting the
    other must not take that chain (and leak its slots): it never held it."""
    world = World("chain", "none")
    engine = Engine(world)
    first, second = engine.add([1, 2, 3], "x"), engine.add([1, 2, 4], "x")
    assert first.chain_status == second.chain_status == "not_found"
    assert engine.admit(first, 5) and engine.admit(second, 6)
    engine.finish(first)
    engine.abort(second)
    chain = world.store.chains.chains["x"]
    assert chain.owner == first.seq_id and world.pool.resident(first.seq_id) == 3
    assert world.store.reclaimable_slots == 3
    assert engine.add([1, 2, 3, 5, 7], "x").chain_status == "continued"


def test_a_turn_parked_under_the_id_of_a_chain_being_extended_leaves_it_alone():
    """One writer per chain: a request that named an unknown id finishes after another
    request parked a chain under that id and a third continued it; the running third
    request keeps the chain (and its KV), the late turn's state is freed."""
    world = World("chain", "none")
    engine = Engine(world)
    late, early = engine.add([1, 2, 3], "x"), engine.add([3, 3], "x")
    assert engine.admit(late, 1) and engine.admit(early, 2)
    engine.finish(early)
    third = engine.add([3, 3, 2, 1], None)  # extends "x": continues it
    assert third.chain_status == "continued" and third.seq_id == early.seq_id
    assert engine.admit(third, 1)
    engine.finish(late)
    assert world.store.chains.chains["x"].owner == third.seq_id
    assert world.pool.has(third.seq_id) and not world.pool.has(late.seq_id)


def test_idle_chains_with_uneven_groups_promise_only_the_room_they_free():
    """A chain holding fewer slots in one layer group frees fewer there: the pool counts
    on the emptiest group's share, so an append it allows always succeeds."""
    world = World("chain", "none")  # 24 slots in each of two layer groups
    engine = Engine(world)
    idle = engine.add([1] * 8, None)
    engine.admit(idle, 1)
    engine.evict(idle, group=1, keep_every=2)  # keeps 4 of 8 in group 1
    engine.finish(idle)
    chain = world.store.chains.by_owner(idle.seq_id)
    assert (chain.resident, chain.reclaim) == (8, 4)
    running = engine.add([2] * 12, None)
    engine.admit(running, 1)
    engine.evict(running, group=0, keep_every=2)  # free: 10 in group 0, 8 in group 1
    assert world.pool.can_append(12) and not world.pool.can_append(13)
    world.pool.append(999, 12)  # the chain goes, group 1 has room
    assert world.store.chains.chains == {}
