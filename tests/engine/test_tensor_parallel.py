"""Tensor parallelism on the CPU (gloo, two processes): the greedy tokens of TP=2 equal
TP=1's for every method that runs over ranks, with chunked prefill, preemption, chains
(also restored from the CPU and disk tiers), pruning and the radix cache; the server
serves with TP=2; a rank that dies fails the engine with an error, not a hang.

Each TP=2 engine starts a worker process (spawn), so the cases share engines where the
engine's method set allows it: one engine serves every per-layer method, requests choose.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from deltakv_serving import make_checkpoint
from engine_helpers import EVERY_LAYER_SPARSE, run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.config import EngineConfig
from sparsevllm.engine.tensor_parallel import RankFailure
from sparsevllm.sparse.registry import all_specs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Small budgets: every method evicts or selects within these prompts.
SELECTING = {"decode_keep_tokens": 24, "recent_keep_tokens": 8}
KNOBS: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "streamingllm": {"sink_keep_tokens": 4, "recent_keep_tokens": 20},
    "quest": {"decode_keep_tokens": 16, "quest_chunk_size": 4},
    "tova": {"decode_keep_tokens": 24},
    # Layer 0 attends fully and picks for the layers after it (the mean over every
    # rank's heads).
    "omnikv": {"decode_keep_tokens": 16},
}
# Quest keeps one slot table for all layers: it cannot share an engine with the methods
# that evict per layer. DuoAttention needs head scores of the 4-layer model.
OWN_ENGINE = ("quest", "duoattention")
# DeltaKV needs a checkpoint: its own test below.
PER_LAYER = [s.name for s in all_specs() if s.name not in (*OWN_ENGINE, "deltakv")]
ENGINE = dict(device="cpu", dtype="float32", chunk_prefill_size=7, max_num_seqs=4)


def prompts(n: int) -> list[list[int]]:
    return [[1] + [(7 * i + 3 * j) % 240 + 5 for j in range(30 + 11 * (i % 5))] for i in range(n)]


def params(method: str) -> SamplingParams:
    knobs = KNOBS.get(method, SELECTING)
    return SamplingParams(
        temperature=0.0, max_tokens=12, sparse_method=method, sparse_knobs=knobs or None
    )


def generate_both(model: str, methods: list[str], **engine: Any) -> dict[int, list[list[int]]]:
    """Every method's request through one TP=1 and one TP=2 engine serving them all (a
    single method: four requests with the engine's settings)."""
    requests = prompts(len(methods) if len(methods) > 1 else 4)
    choices = [params(m) for m in methods] if len(methods) > 1 else GREEDY
    tokens = {}
    for tp in (1, 2):
        config = dict(ENGINE, sparse_method=methods[0], sparse_methods=methods[1:], **engine)
        with LLM(model, tensor_parallel_size=tp, **config) as llm:
            outs = llm.generate(requests, choices, use_tqdm=False)
            tokens[tp] = [o.outputs[0].token_ids for o in outs]
            if engine.get("num_kv_slots", 4096) < 4096:
                assert llm.stats()["num_preemptions"] > 0  # the small pool preempted
    return tokens


@pytest.mark.parametrize("pool", [4096, 160], ids=["roomy", "preempting"])
def test_every_method_keeps_tp1s_tokens(tiny_model_factory, pool):
    model = tiny_model_factory("llama")
    tokens = generate_both(model, PER_LAYER, num_kv_slots=pool)
    for method, one, two in zip(PER_LAYER, tokens[1], tokens[2]):
        assert one == two, method
    llama4 = tiny_model_factory("llama4")
    quest = generate_both(llama4, ["vanilla", "quest"])
    assert quest[1] == quest[2]
    duo = dict(EVERY_LAYER_SPARSE["duoattention"], sink_keep_tokens=4, recent_keep_tokens=8)
    streaming = generate_both(llama4, ["duoattention"], **duo)
    assert streaming[1] == streaming[2]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "gemma3", "mixtral"])
def test_model_families_split_over_ranks(tiny_model_factory, tmp_path_factory, kind):
    """Biases (Qwen2), q/k norms (Qwen3), sliding layers and tied embeddings (Gemma 3),
    replicated experts beside split attention (Mixtral)."""
    if kind == "gemma3":
        from tiny_gemma3 import save_tiny_gemma3

        model = save_tiny_gemma3(tmp_path_factory.mktemp("gemma3_tp"))
        ids = {"max_model_len": 512}
    else:
        model, ids = tiny_model_factory(kind), {}
    tokens = generate_both(model, ["vanilla", "snapkv", "h2o"], **ids)
    assert tokens[1] == tokens[2]


FIRST = [1] + [(5 * i) % 240 + 3 for i in range(120)]
NEW = [9, 8, 7]
SNAPKV = dict(ENGINE, sparse_method="snapkv", decode_keep_tokens=40, recent_keep_tokens=8)
PRESSURE = dict(num_kv_slots=300, chunk_prefill_size=64)


def squeeze(llm: LLM) -> None:
    """Other conversations that need the pool (the idle chain leaves it)."""
    for j in range(3):
        run_request(llm.engine, [2] + [(7 * i + j) % 240 + 3 for i in range(200)], GREEDY)


def two_turns(llm: LLM, between=None) -> tuple[Any, Any]:
    first = run_request(llm.engine, FIRST, GREEDY, "keep")[0]
    if between is not None:
        between(llm)
    second = run_request(llm.engine, FIRST + first.token_ids + NEW, GREEDY, "keep")[0]
    return first, second


def test_chains_continue_and_restore_from_the_tiers(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama4")
    with LLM(model, **SNAPKV) as llm:
        first, second = two_turns(llm)
    for tp, tiers in ((2, {"cpu_offload_gb": 0.5}), (2, {"disk_offload_dir": str(tmp_path)})):
        with LLM(model, tensor_parallel_size=tp, **{**SNAPKV, **PRESSURE, **tiers}) as llm:
            one, two = two_turns(llm, squeeze)
            assert one.token_ids == first.token_ids
            assert two.token_ids == second.token_ids
            assert two.chain_status.startswith("continued (restored from")
            assert two.num_cached_tokens == second.num_cached_tokens > len(FIRST)
    # Each rank wrote its own shard, in a directory of its own.
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_pruned_chain_continues_as_on_one_rank(tiny_model_factory, method):
    """AdaKV's state spans the model's heads: pruning hands it every rank's keep."""
    model = tiny_model_factory("llama4")
    outs = {}
    for tp in (1, 2):
        with LLM(model, tensor_parallel_size=tp, **dict(SNAPKV, sparse_method=method)) as llm:
            first = run_request(llm.engine, FIRST, GREEDY, "keep")[0]
            pruned = llm.prune("keep", ranges=[(10, 90)], method="knorm", keep_ratio=0.3)
            second = run_request(llm.engine, FIRST + first.token_ids + NEW, GREEDY, "keep")[0]
            outs[tp] = (first.token_ids, pruned.slots_freed, second.token_ids)
    assert outs[1] == outs[2]


def test_radix_cache_reuse_keeps_tp1s_tokens(tiny_model_factory):
    model = tiny_model_factory("llama")
    shared = [1] + [(3 * i) % 240 + 5 for i in range(60)]
    requests = [shared + [7, 8], shared + [9, 10, 11]]
    outs = {}
    for tp in (1, 2):
        config = dict(ENGINE, enable_prefix_caching=True)
        with LLM(model, tensor_parallel_size=tp, **config) as llm:
            outs[tp] = [run_request(llm.engine, p, GREEDY)[0] for p in requests]
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[2]]
    assert outs[2][1].num_cached_tokens == outs[1][1].num_cached_tokens > 0


def test_sampled_tokens_agree_over_ranks(tiny_model_factory):
    """Unseeded sampling draws on each rank's own RNG: the driver's tokens are the ones
    every rank continues with, so the ranks' KV stays one sequence (a second turn on the
    chain equals recomputing it)."""
    model = tiny_model_factory("llama")
    sampled = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as llm:
        first = llm.generate([FIRST], sampled, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate([FIRST + first], GREEDY, use_tqdm=False)[0]
    with LLM(model, **ENGINE) as llm:
        assert llm.generate([FIRST + first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == (
            again.outputs[0].token_ids
        )


@pytest.mark.parametrize("hidden,topk", [(0, 0), (8, 6)], ids=["linear-all", "mlp-topk"])
def test_deltakv_compresses_over_ranks_as_on_one(tiny_model_factory, tmp_path, hidden, topk):
    """One latent per token from every rank's heads (the down map's partial products and
    the center distances summed over ranks), each rank reconstructing its own heads;
    with preemption, a top-k of compressed tokens scored over every head, and a chain
    continued in a second turn from the radix cache."""
    model = tiny_model_factory("llama4")
    ckpt = make_checkpoint(model, tmp_path / "dk.safetensors", hidden=hidden)
    knobs = dict(
        deltakv_checkpoint=ckpt, deltakv_topk=topk, sink_keep_tokens=4, recent_keep_tokens=8
    )
    tokens = generate_both(model, ["deltakv"], num_kv_slots=160, **knobs)
    assert tokens[1] == tokens[2]
    turns = {}
    for tp in (1, 2):
        config = dict(ENGINE, sparse_method="deltakv", **knobs)
        with LLM(model, tensor_parallel_size=tp, **config) as llm:
            first, second = two_turns(llm)
            assert second.num_cached_tokens > len(FIRST)
            turns[tp] = (first.token_ids, second.token_ids)
    assert turns[1] == turns[2]


def test_bad_tensor_parallel_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="names one GPU"):
        EngineConfig(device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cpu_compile on compiles whole decoder layers"):
        EngineConfig(cpu_compile="on", tensor_parallel_size=2)


def test_more_ranks_than_kv_heads(tiny_model_factory, tmp_path):
    """Four ranks over two KV heads replicate each KV head on two ranks: dense serving
    works, a method that scores whole query groups is refused, and so is DeltaKV (a
    replicated head would count twice in the ranks' sums)."""
    model = tiny_model_factory("llama")
    with LLM(model, tensor_parallel_size=4, **ENGINE) as llm:
        four = llm.generate(prompts(2), GREEDY, use_tqdm=False)
    with LLM(model, **ENGINE) as llm:
        one = llm.generate(prompts(2), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in four] == [o.outputs[0].token_ids for o in one]
    # The driver's own error, or a worker's with the same words (whichever shows first).
    with pytest.raises((ValueError, RankFailure), match="exceeds the model's 2 KV heads"):
        LLM(model, tensor_parallel_size=4, **dict(ENGINE, sparse_method="snapkv"))
    ckpt = make_checkpoint(model, tmp_path / "dk.safetensors")
    deltakv = dict(ENGINE, sparse_method="deltakv", deltakv_checkpoint=ckpt)
    with pytest.raises((ValueError, RankFailure), match="more tensor-parallel ranks than"):
        LLM(model, tensor_parallel_size=4, **deltakv)


def test_a_dead_rank_fails_the_engine_cleanly(tiny_model_factory):
    model = tiny_model_factory("llama")
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.generate(prompts(1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        worker = llm.engine.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
            llm.generate(prompts(2), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
        with pytest.raises(RankFailure):  # and stays failed
            llm.engine.step()
    finally:
        llm.close()  # what could be saved needs every rank: nothing is, nothing raises
