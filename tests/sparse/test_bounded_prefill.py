"""Bounded-memory prefill in the engine (EngineConfig.bounded_prefill): a prompt ten times
the budget runs with at most budget + chunk resident tokens per layer at every step
(SnapKV, PyramidKV, H2O; full-precision, int8 and int4 KV); a budget covering the prompt gives unbounded prefill's tokens; a
prompt longer than the pool is admitted when it will be bounded and refused, with a hint,
when not; and the engine's layer-0 selection equals the plain reference of the rule
(layer 0's queries and keys do not depend on what earlier cuts kept, so a dense run
records them)."""

from __future__ import annotations

import math

import pytest
import torch

from bounded_reference import ref_bounded_snapkv
from sparsevllm import LLM, SamplingParams
from sparsevllm.config import EngineConfig
from sparsevllm.engine.capacity import CapacityPlan
from sparsevllm.sparse.base import SparseMethod
from sparsevllm.sparse.registry import register_method, unregister_method
from sparsevllm.sparse.spec import MethodSpec

PROMPT = [1] + [(37 * i + 11) % 240 + 3 for i in range(240)]  # 241 tokens
BUDGET, CHUNK = 24, 8
SMALL = {
    "decode_keep_tokens": BUDGET,
    "sink_keep_tokens": 4,
    "recent_keep_tokens": 8,
    "snapkv_window_size": 8,
    "chunk_prefill_size": CHUNK,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def run_traced(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    """Run one request to its end: its tokens, and after every engine step the most slots
    each layer held during the step and the slots it holds after it."""
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    seq = engine._by_request[rid]
    peaks, used = [], []
    while engine.has_unfinished_requests():
        engine.pool.reset_peak()
        engine.step()
        peaks.append(engine.pool.peak_used_per_layer())
        used.append(engine.pool.used_per_layer())
    return seq, peaks, used


@pytest.mark.parametrize(
    "method,fmt",
    [
        ("snapkv", "auto"),
        ("snapkv", "int8"),
        ("snapkv", "int4"),
        ("pyramidkv", "auto"),
        ("h2o", "auto"),
        ("h2o", "int4"),
    ],
)
def test_kv_never_exceeds_budget_plus_chunk(model, method, fmt):
    knobs = dict(SMALL, sparse_method=method, kv_cache_dtype=fmt, bounded_prefill="on")
    if method == "h2o":
        del knobs["snapkv_window_size"]
    if fmt == "int4":  # groups and a residual small enough to seal during the prompt
        knobs.update(kv_quant_group_size=8, kv_quant_residual=8)
    if method == "pyramidkv":  # its policy would prefill this prompt alone, in full
        knobs.update(long_prefill_offload_threshold=16, pyramidkv_beta=4.0)
    llm = LLM(model, **knobs)
    budgets = [llm.engine.method.layer_budget(layer) for layer in range(4)]
    seq, peaks, used = run_traced(llm, PROMPT)
    assert seq.bounded_prefill and len(seq.output_token_ids) == 4
    assert len(peaks) == math.ceil(len(PROMPT) / CHUNK) + 3  # chunked, then 3 decodes
    for step in peaks:
        assert all(p <= b + CHUNK for p, b in zip(step, budgets)), (step, budgets)
    prompt_steps = used[: math.ceil(len(PROMPT) / CHUNK)]
    assert all(all(u <= b for u, b in zip(step, budgets)) for step in prompt_steps)
    assert used[-1] == [b + 3 for b in budgets]  # the budget, then the decoded tokens
    if method == "pyramidkv":
        assert len(set(budgets)) > 1


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_a_budget_covering_the_prompt_gives_unbounded_tokens(model, method):
    covering = dict(SMALL, sparse_method=method, decode_keep_tokens=4096)
    if method == "h2o":
        del covering["snapkv_window_size"]
    off = LLM(model, **covering).generate([PROMPT], GREEDY, use_tqdm=False)
    on = LLM(model, bounded_prefill="on", **covering).generate([PROMPT], GREEDY, use_tqdm=False)
    assert on[0].token_ids == off[0].token_ids


def test_no_cut_before_the_prompt_end_is_unbounded_prefill(model):
    """Budget 200, chunks 128 + 113: no layer is above the budget before the last chunk,
    so bounded prefill selects once, at the prompt's end, as unbounded prefill does."""
    knobs = dict(SMALL, sparse_method="snapkv", decode_keep_tokens=200, chunk_prefill_size=128)
    runs = []
    for mode in ("off", "on"):
        llm = LLM(model, bounded_prefill=mode, **knobs)
        seq, _, used = run_traced(llm, PROMPT)
        kv = llm.engine.runner.kv  # the finished turn is an idle chain: its views stay
        kept = [kv.logical_positions(seq.seq_id, g).tolist() for g in range(4)]
        runs.append((seq.output_token_ids, kept, used[1]))
    assert runs[0] == runs[1]
    assert runs[1][2] == [200] * 4  # it did select


def test_a_prompt_longer_than_the_pool_is_admitted_only_when_bounded(model):
    prompt = [1] + [(13 * i + 5) % 240 + 3 for i in range(960)]  # 961 tokens, pool 64
    knobs = dict(SMALL, sparse_method="snapkv", chunk_prefill_size=32, num_kv_slots=64)
    with pytest.raises(ValueError, match="bounded_prefill 'auto' or 'on'.* about 56"):
        LLM(model, **knobs).engine.validate(prompt, GREEDY)
    llm = LLM(model, bounded_prefill="auto", **knobs)
    seq, peaks, _ = run_traced(llm, prompt)
    assert seq.bounded_prefill and seq.finish_reason == "length"
    assert max(max(step) for step in peaks) <= BUDGET + 32
    assert llm.stats()["num_preemptions"] == 0
    # auto leaves a prompt alone when its full KV fits and it is under the threshold.
    short, _, _ = run_traced(llm, PROMPT[:40])
    assert not short.bounded_prefill


def test_auto_bounds_long_prompts_and_those_the_pool_cannot_hold():
    config = EngineConfig(
        sparse_method="snapkv", bounded_prefill="auto", bounded_prefill_threshold=1000
    )
    plan = CapacityPlan.derive(config, 4096, "all_chunked")
    assert plan.bounds_prefill(True, 1001, 1001, 10**6)  # past the threshold
    assert plan.bounds_prefill(True, 500, 500, 400)  # its full KV would not fit
    assert not plan.bounds_prefill(True, 500, 500, 600)
    assert not plan.bounds_prefill(False, 5000, 5000, 400)  # the method cannot
    on = CapacityPlan.derive(config.replace(bounded_prefill="on"), 4096, "all_chunked")
    assert on.bounds_prefill(True, 10, 10, 10**6)
    off = CapacityPlan.derive(EngineConfig(), 4096, "all_chunked")
    assert not off.bounds_prefill(True, 5000, 5000, 400)


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"sparse_method": "rkv"}, r"rkv cannot .* methods that can: snapkv, pyramidkv, h2o"),
        ({"sparse_method": "snapkv", "sparse_methods": "tova"}, r"tova cannot cut"),
        ({"sparse_method": "vanilla"}, r"vanilla cannot cut"),
    ],
)
def test_bounded_prefill_needs_methods_that_can_cut_between_chunks(settings, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.create(bounded_prefill="on", **settings)
    EngineConfig.create(**settings)  # off: any method


def test_bounded_prefill_settings_are_validated():
    with pytest.raises(ValueError, match="bounded_prefill must be one of off, auto, on"):
        EngineConfig.create(sparse_method="snapkv", bounded_prefill="yes")
    with pytest.raises(ValueError, match="did you mean 'bounded_prefill'"):
        EngineConfig.create(sparse_method="snapkv", bounded_prefil="on")
    with pytest.raises(ValueError, match="bounded_prefill_threshold must be a positive"):
        EngineConfig.create(sparse_method="snapkv", bounded_prefill_threshold=0)


# -- the engine's layer-0 selection against the reference ------------------------------
class RecordQK(SparseMethod):
    """Dense; records layer 0's post-RoPE queries and keys of every prompt chunk."""

    name = "record_qk_test"
    q: list[torch.Tensor] = []
    k: list[torch.Tensor] = []

    def prefill_query_rows(self, step):
        return step.num_new

    def observe_queries(self, layer, step, q, kv):
        if layer == 0:
            RecordQK.q.append(q.clone())

    def after_step(self, steps, scores, kv):
        for step in steps:
            if not step.is_decode:
                RecordQK.k.append(kv.keys(step.seq_id, 0, step.start, step.end).clone())


RECORD = MethodSpec(
    name="record_qk_test", family="dense", description="records q/k", method=RecordQK
)


@pytest.fixture
def recorded(model):
    """Layer 0's queries `[N, Hq, D]` and keys `[N, Hkv, D]` of PROMPT, from the engine."""
    register_method(RECORD)
    RecordQK.q, RecordQK.k = [], []
    try:
        llm = LLM(model, sparse_method="record_qk_test", chunk_prefill_size=CHUNK)
        llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        unregister_method(RECORD.name)
    return torch.cat(RecordQK.q), torch.cat(RecordQK.k)


def test_engine_layer0_selection_is_the_reference(model, recorded):
    q, k = recorded
    assert q.shape[0] == k.shape[0] == len(PROMPT)
    knobs = dict(SMALL, sparse_method="snapkv", snapkv_pool_kernel_size=1, bounded_prefill="on")
    llm = LLM(model, **knobs)
    seq, _, _ = run_traced(llm, PROMPT, SamplingParams(max_tokens=1))
    group = llm.engine.pool.group_of_layer[0]
    kept = llm.engine.runner.kv.logical_positions(seq.seq_id, group).tolist()
    chunks = [CHUNK] * (len(PROMPT) // CHUNK) + [len(PROMPT) % CHUNK]
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref, gap = ref_bounded_snapkv(q, k, chunks, BUDGET, 4, 8, 8, 1, scale)
    assert gap > 1e-5, "near-tie at a cut: the engine may choose either"
    assert kept == ref


def test_bounded_sequences_survive_preemption(model):
    """Two bounded prompts in a pool that cannot hold both at budget + chunk: one is
    preempted, prefills again (bounded again) and both finish."""
    llm = LLM(model, sparse_method="snapkv", bounded_prefill="on", num_kv_slots=60, **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    other = [1] + [(11 * i + 7) % 240 + 3 for i in range(240)]
    outs = llm.generate([PROMPT, other], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [20, 20]
    stats = llm.stats()
    assert stats["num_preemptions"] >= 1
    assert stats["kv_slots_peak"] <= 60
