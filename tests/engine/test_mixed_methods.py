"""Per-request sparse methods: one engine serves several, one batch mixes them.

The oracle is a single-method engine per method: each request of a mixed batch must get
exactly the greedy tokens its method's own engine gives it (same chunking), with chunked
prefill, overlapped scheduling, the radix prefix cache and the chain cache.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_helpers import MATRIX_PROMPTS, METHOD_KNOBS, run_request
from sparsevllm import LLM, SamplingParams
from sparsevllm.sparse.registry import budget_overrides, method_spec

GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
PROMPTS = MATRIX_PROMPTS + [p[:-2] + [7, 8] for p in MATRIX_PROMPTS]
# Eviction at prefill end and while decoding, one group and per-layer groups, decode
# views computed per head (adakv) and per row (omnikv): all in one batch.
EVICTING = ["vanilla", "snapkv", "h2o", "streamingllm", "omnikv", "adakv", "tova"]
# The radix prefix cache serves methods whose storage stays a plain prefix.
PREFIX = ["vanilla", "omnikv", "quest"]


def request_knobs(method: str) -> dict[str, Any]:
    """The test knobs of `method` that it reads (a request may set only those)."""
    return {k: v for k, v in METHOD_KNOBS[method].items() if k in method_spec(method).settings}


def params_for(method: str) -> SamplingParams:
    return SamplingParams(**GREEDY, sparse_method=method, sparse_knobs=request_knobs(method))


def assigned(methods: list[str], shift: int = 0) -> list[str]:
    return [methods[(i + shift) % len(methods)] for i in range(len(PROMPTS))]


def single_method_tokens(model: str, methods: list[str], **engine: Any) -> list[list[int]]:
    """Each prompt's tokens from an engine that serves only its assigned method."""
    out: dict[int, list[int]] = {}
    for method in set(methods):
        idx = [i for i, m in enumerate(methods) if m == method]
        llm = LLM(model, sparse_method=method, **METHOD_KNOBS[method], **engine)
        params = SamplingParams(**GREEDY)
        outs = llm.generate([PROMPTS[i] for i in idx], params, use_tqdm=False)
        out.update({i: o.token_ids for i, o in zip(idx, outs)})
    return [out[i] for i in range(len(PROMPTS))]


def mixed_tokens(llm: LLM, methods: list[str]) -> list[list[int]]:
    outs = llm.generate(PROMPTS, [params_for(m) for m in methods], use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.mark.parametrize(
    "engine",
    [{}, {"chunk_prefill_size": 7}, {"chunk_prefill_size": 7, "async_scheduling": True}],
    ids=["whole", "chunked", "overlapped"],
)
def test_mixed_batch_gives_each_request_its_own_methods_tokens(model, engine):
    methods = assigned(EVICTING)
    chunking = {k: v for k, v in engine.items() if k == "chunk_prefill_size"}
    expected = single_method_tokens(model, methods, **chunking)
    llm = LLM(model, sparse_methods=EVICTING[1:], **engine)
    assert llm.engine.config.prefix_cache_mode == "chain"
    assert mixed_tokens(llm, methods) == expected
    stats = llm.stats()
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]  # only idle chains hold slots


def test_mixed_batch_with_preemption_finishes_and_returns_every_slot(model):
    llm = LLM(model, sparse_methods=EVICTING[1:], num_kv_slots=110, chunk_prefill_size=7)
    methods = assigned(EVICTING, shift=3)
    outs = llm.generate(PROMPTS, [params_for(m) for m in methods], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [GREEDY["max_tokens"]] * len(PROMPTS)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]


def test_radix_cache_serves_a_prefix_to_every_method(model):
    methods = assigned(PREFIX)
    expected = single_method_tokens(model, methods)
    llm = LLM(model, sparse_methods=PREFIX[1:])
    assert llm.engine.config.prefix_cache_mode == "radix"
    assert mixed_tokens(llm, methods) == expected
    before = llm.stats()["num_cached_prompt_tokens"]
    # The same prompts under other methods: their prefixes come from the cache.
    shifted = assigned(PREFIX, shift=1)
    assert mixed_tokens(llm, shifted) == single_method_tokens(model, shifted)
    assert llm.stats()["num_cached_prompt_tokens"] - before >= sum(len(p) - 1 for p in PROMPTS)


def test_request_budget_equals_an_engine_started_with_it(model):
    budget = 20
    ref = LLM(model, sparse_method="snapkv", **budget_overrides("snapkv", budget))
    expected = ref.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    llm = LLM(model, sparse_method="snapkv")  # the engine's own budget: 2048
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY, kv_budget=budget), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    # The budget is real: the idle chains keep what the budgeted engine's keep.
    used = llm.stats()["kv_slots_used_per_layer"]
    assert used == ref.stats()["kv_slots_used_per_layer"]
    assert max(used) < sum(len(p) + GREEDY["max_tokens"] - 1 for p in PROMPTS)


def test_a_chain_continues_only_under_the_choice_that_built_it(model):
    llm = LLM(model, sparse_methods=["snapkv", "h2o"], decode_keep_tokens=24, recent_keep_tokens=8)
    engine, prompt = llm.engine, PROMPTS[0]
    snap = SamplingParams(**GREEDY, sparse_method="snapkv")
    out, _ = run_request(engine, prompt, snap, chain_id="conv")
    turn2 = prompt + out.token_ids + [5, 6, 7]
    with pytest.raises(ValueError, match="another sparse method choice"):
        engine.add_request(turn2, SamplingParams(**GREEDY, sparse_method="h2o"), chain_id="conv")
    # Unnamed: a request of another choice does not take the chain over.
    other, _ = run_request(engine, turn2, SamplingParams(**GREEDY, sparse_method="h2o"))
    assert other.chain_status == "new"
    again, prefilled = run_request(engine, turn2, snap, chain_id="conv")
    assert again.chain_status == "continued" and prefilled == 4


@pytest.mark.parametrize(
    ("params", "message", "param"),
    [
        ({"sparse_method": "snapk"}, "did you mean 'snapkv'", "sparse_method"),
        ({"sparse_method": "quest"}, "--sparse-methods snapkv,quest", "sparse_method"),
        (
            {"sparse_method": "snapkv", "sparse_knobs": {"window": 8}},
            "its settings:",
            "sparse_knobs",
        ),
        (
            {"sparse_method": "snapkv", "sparse_knobs": {"snapkv_window_size": 0}},
            ">= 1",
            "sparse_knobs",
        ),
        ({"kv_budget": 64}, "no KV budget knob", "kv_budget"),
    ],
)
def test_bad_choices_are_refused_with_the_valid_ones(model, params, message, param):
    llm = LLM(model, sparse_methods=["snapkv"])
    with pytest.raises(ValueError, match=message) as info:
        llm.generate([PROMPTS[0]], SamplingParams(**GREEDY, **params), use_tqdm=False)
    assert getattr(info.value, "param", None) == param
    assert not llm.engine.has_unfinished_requests()


def test_methods_of_incompatible_layouts_are_refused_at_start(model):
    with pytest.raises(ValueError, match="quest keeps 1 slot table"):
        LLM(model, sparse_methods=["snapkv", "quest"])
    with pytest.raises(ValueError, match="radix' needs storage that stays a plain prefix"):
        LLM(model, sparse_methods=["snapkv"], prefix_cache_mode="radix")


def write_calibration_for(model: str, directory) -> None:
    """A calibration of SnapKV on the tiny model measured at 64-token prompts: relative
    accuracy 0.6 / 0.85 / 0.97 at kept fractions 0.25 / 0.5 / 0.75."""
    from transformers import AutoConfig

    from sparsevllm.calibration.identity import model_identity
    from sparsevllm.calibration.schema import (
        Calibration,
        Coverage,
        MethodCurve,
        Point,
        write_calibration,
    )

    identity = model_identity(model, AutoConfig.from_pretrained(model).to_dict())
    points = tuple(
        Point(64, kept, rel, rel / 2, 0.5, 20, ("niah_single",))
        for kept, rel in ((0.25, 0.6), (0.5, 0.85), (0.75, 0.97))
    )
    curve = MethodCurve((Coverage(64, 66),), points)
    cal = Calibration(identity, {"snapkv": curve}, (), "synthetic, for the test")
    write_calibration(cal, directory / "tiny.json")


def test_auto_budget_follows_the_calibration(model, tmp_path):
    write_calibration_for(model, tmp_path)
    llm = LLM(model, sparse_method="snapkv", calibration_dir=str(tmp_path))
    engine, prompt = llm.engine, PROMPTS[0]  # 61 tokens

    def chosen(floor: float) -> int:
        params = SamplingParams(**GREEDY, kv_budget="auto", min_accuracy=floor)
        return engine.method_choice(prompt, params).decode_keep_tokens

    # A stricter floor keeps more: ceil(kept fraction x 64 measured tokens).
    assert chosen(0.5) == 16 and chosen(0.8) == 32 and chosen(0.95) == 48
    # No calibrated budget reaches 0.99 of the full context: it keeps everything.
    assert chosen(0.99) == engine.max_model_len
    auto = SamplingParams(**GREEDY, kv_budget="auto", min_accuracy=0.8)
    explicit = SamplingParams(**GREEDY, kv_budget=32)
    a, b = llm.generate([prompt, prompt], [auto, explicit], use_tqdm=False)
    assert a.token_ids == b.token_ids
    full = llm.generate([prompt], SamplingParams(**GREEDY, kv_budget="auto", min_accuracy=0.99))
    dense = LLM(model).generate([prompt], SamplingParams(**GREEDY), use_tqdm=False)
    assert full[0].token_ids == dense[0].token_ids


def test_auto_budget_without_a_calibration_says_how_to_make_one(model, tmp_path):
    llm = LLM(model, sparse_method="snapkv", calibration_dir=str(tmp_path))
    params = SamplingParams(**GREEDY, kv_budget="auto")
    with pytest.raises(ValueError, match="sparsevllm calibrate") as info:
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert getattr(info.value, "param", None) == "kv_budget"
