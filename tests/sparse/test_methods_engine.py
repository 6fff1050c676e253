"""Every sparse method inside the engine: vanilla equivalence, budgets, memory, scheduling."""

from __future__ import annotations

import pytest

from engine_helpers import EVERY_LAYER_SPARSE, MATRIX_PROMPTS, SPARSE_METHODS, covering_budget
from sparsevllm import LLM, SamplingParams
from sparsevllm.sparse.pyramidkv import pyramid_budgets

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LAYOUT = EVERY_LAYER_SPARSE
SPARSE = SPARSE_METHODS
PROMPTS = MATRIX_PROMPTS


def big_budget(method: str) -> dict:
    return covering_budget(method, recent=64)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def vanilla_tokens(model):
    return [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", SPARSE)
def test_budget_above_context_reproduces_vanilla(model, vanilla_tokens, method):
    outs = LLM(model, **big_budget(method)).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == vanilla_tokens


@pytest.mark.parametrize("method", SPARSE)
def test_chunked_prefill_and_preemption_with_large_budget(model, vanilla_tokens, method):
    llm = LLM(model, num_kv_slots=110, chunk_prefill_size=7, **big_budget(method))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == vanilla_tokens
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_slots_used"] == stats["kv_slots_cached"]


@pytest.mark.parametrize("method", SPARSE)
def test_small_budget_with_chunks_mixed_lengths_and_preemption(model, method):
    llm = LLM(
        model,
        sparse_method=method,
        decode_keep_tokens=16,
        sink_keep_tokens=2,
        recent_keep_tokens=4,
        chunk_prefill_size=7,
        num_kv_slots=120,
        **LAYOUT.get(method, {}),
        **({"quest_chunk_size": 4} if method == "quest" else {}),
    )
    outs = llm.generate(
        PROMPTS * 2, SamplingParams(max_tokens=40, ignore_eos=True, seed=0), use_tqdm=False
    )
    assert [len(o.token_ids) for o in outs] == [40] * 8
    stats = llm.stats()
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]  # every slot came back


def resident_after_each_step(llm: LLM, prompt: list[int], max_tokens: int) -> list[list[int]]:
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    trace = []
    while engine.has_unfinished_requests():
        engine.step()
        trace.append(engine.stats()["kv_slots_used_per_layer"])
    return trace


@pytest.mark.parametrize(
    "method", ["snapkv", "pyramidkv", "streamingllm", "knorm", "keydiff", "lagkv", "strided"]
)
def test_resident_slots_equal_budget_after_prefill(model, method):
    knobs = {"decode_keep_tokens": 24, "sink_keep_tokens": 4, "recent_keep_tokens": 8}
    if method == "streamingllm":
        knobs = {"sink_keep_tokens": 4, "recent_keep_tokens": 20}
    llm = LLM(model, sparse_method=method, **knobs)
    trace = resident_after_each_step(llm, PROMPTS[0], 3)  # 61 prompt tokens, one full step
    expected = [24] * 4
    if method == "pyramidkv":
        expected = pyramid_budgets(24, 4, llm.config.method_knobs.pyramidkv_beta, 4 + 8 + 1)
        assert expected[0] > expected[-1]
    assert trace[0] == expected


def test_adakv_view_is_as_wide_as_its_widest_head(model):
    knobs = {"decode_keep_tokens": 24, "sink_keep_tokens": 4, "recent_keep_tokens": 8}
    llm = LLM(model, sparse_method="adakv", **knobs)
    trace = resident_after_each_step(llm, PROMPTS[0], 3)  # 61 prompt tokens, one full step
    method = llm.engine.runner.method
    worst = method.decode_resident(61, 0)
    assert all(24 <= n <= worst for n in trace[0])
    assert max(trace[0]) > 24  # some head took more than the uniform share
    assert trace[1] == [n + 1 for n in trace[0]]  # decode appends


@pytest.mark.parametrize("method", ["h2o", "rkv", "tova", "streamingllm"])
def test_long_decode_stays_within_budget_plus_interval(model, method):
    budget, interval = 20, 8
    knobs = {
        "h2o": {
            "h2o_decode_budget": budget,
            "h2o_decode_eviction_interval": interval,
            "sink_keep_tokens": 2,
            "recent_keep_tokens": 6,
        },
        "rkv": {
            "decode_keep_tokens": budget,
            "rkv_interval": interval,
            "sink_keep_tokens": 2,
            "recent_keep_tokens": 6,
        },
        "tova": {"decode_keep_tokens": budget, "sink_keep_tokens": 0, "recent_keep_tokens": 0},
        "streamingllm": {"sink_keep_tokens": 4, "recent_keep_tokens": budget - 4},
    }[method]
    llm = LLM(model, sparse_method=method, chunk_prefill_size=16, **knobs)
    trace = resident_after_each_step(llm, PROMPTS[0], 120)
    prompt_steps = -(-len(PROMPTS[0]) // 16)
    if method != "streamingllm":  # positional: it may cut every chunk, the same anyway
        # The prompt's chunks only vote: it is cut once, at its end.
        assert [max(layers) for layers in trace[: prompt_steps - 1]] == [16, 32, 48]
        trace = trace[prompt_steps - 1 :]
    peak = max(max(layers) for layers in trace)
    bursts = method in ("h2o", "rkv")
    limit = budget + (interval if bursts else 0)
    assert peak <= limit
    assert trace[-2] and min(trace[-2]) >= budget  # it kept working at the budget
    if bursts:
        assert peak > budget  # the burst really waits for the interval


def test_eviction_frees_memory_for_more_sequences(model):
    prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(999)] for i in range(8)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    pool = 3 * 1000 + 10  # three uncompressed prompts
    common = {
        "num_kv_slots": pool,
        "max_model_len": 1100,
        "chunk_prefill_size": 1024,
        "max_num_batched_tokens": 4096,
    }
    sparse = LLM(model, sparse_method="snapkv", decode_keep_tokens=128, **common)
    outs = sparse.generate(prompts, params, use_tqdm=False)
    stats = sparse.stats()
    assert all(len(o.token_ids) == 16 for o in outs)
    assert stats["max_concurrent_seqs"] == 8 and stats["num_preemptions"] == 0
    dense = LLM(model, **common)
    dense.generate(prompts, params, use_tqdm=False)
    stats = dense.stats()
    assert stats["max_concurrent_seqs"] < 8 or stats["num_preemptions"] > 0
    assert stats["max_concurrent_seqs"] <= 3


def test_explicit_prefill_policy_must_match_registry(model):
    with pytest.raises(ValueError, match="contradicts the registry"):
        LLM(model, sparse_method="pyramidkv", prefill_policy="all_chunked")
    with pytest.raises(ValueError, match="prefill_policy must be one of"):
        LLM(model, sparse_method="snapkv", prefill_policy="bogus")


def test_long_prompts_prefill_alone_in_full(model):
    llm = LLM(
        model,
        sparse_method="pyramidkv",
        long_prefill_offload_threshold=40,
        chunk_prefill_size=16,
        decode_keep_tokens=4096,
        recent_keep_tokens=64,
    )
    scheduler = llm.engine.scheduler
    steps: list[list[tuple[int, int]]] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append([(len(s.seq.prompt_token_ids), s.num_new_tokens) for s in out.scheduled])
        return out

    scheduler.schedule = recording_schedule
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.token_ids) == 4 for o in outs)
    for length in (61, 42):  # above the threshold: alone, in one full step
        assert [st for st in steps if any(n == length for n, _ in st)][0] == [(length, length)]
    short = [k for st in steps for n, k in st if n <= 40]
    assert max(short) == 16  # the others are chunked and batched
    assert any(len(st) > 1 for st in steps)
