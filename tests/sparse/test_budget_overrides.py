"""The method-agnostic KV budget mapping of the registry (`budget_overrides`)."""

from __future__ import annotations

import pytest

from sparsevllm.config import EngineConfig
from sparsevllm.sparse.registry import all_specs, budget_overrides, create_method, method_spec

BUDGETED = [spec.name for spec in all_specs() if spec.budget_knob is not None]
BUDGETS = [1, 2, 4, 5, 36, 37, 100, 2048, 20000]


def test_every_method_but_vanilla_declares_a_budget_knob() -> None:
    assert method_spec("vanilla").budget_knob is None
    assert method_spec("deltakv").budget_knob is None
    # DeltaKV keeps every token (most as latents): no budget bounds what a layer keeps.
    assert sorted(BUDGETED) == sorted({s.name for s in all_specs()} - {"vanilla", "deltakv"})
    names = set(EngineConfig.option_names())
    for name in BUDGETED:
        knob = method_spec(name).budget_knob
        assert knob in names and knob in method_spec(name).settings, name


@pytest.mark.parametrize("method", BUDGETED)
@pytest.mark.parametrize("budget", BUDGETS)
def test_overrides_validate_and_bound_sink_and_recent(method: str, budget: int) -> None:
    overrides = budget_overrides(method, budget)
    config = EngineConfig.create(sparse_method=method, **overrides)  # validates
    sink, recent = config.sink_keep_tokens, config.recent_keep_tokens
    assert sink + recent <= budget and recent >= 1
    assert config.decode_keep_tokens == budget
    knob = method_spec(method).budget_knob
    if method == "streamingllm":
        assert sink + recent == budget
    else:
        assert config.to_dict()[knob] == budget
    if budget >= 36:  # room for the defaults (sink 4, recent 32): they are kept
        assert sink == 4 and (method == "streamingllm" or recent == 32)


def test_sink_and_recent_come_from_the_given_defaults() -> None:
    defaults = {**EngineConfig.knob_defaults(), "sink_keep_tokens": 8, "recent_keep_tokens": 64}
    assert budget_overrides("snapkv", 1000, defaults) == {
        "sink_keep_tokens": 8,
        "recent_keep_tokens": 64,
        "decode_keep_tokens": 1000,
    }
    assert budget_overrides("streamingllm", 1000, defaults)["recent_keep_tokens"] == 992
    h2o = budget_overrides("h2o", 500, defaults)
    assert h2o["h2o_decode_budget"] == 500 and h2o["decode_keep_tokens"] == 500


def test_vanilla_and_bad_budgets_are_rejected() -> None:
    with pytest.raises(ValueError, match="vanilla keeps the whole context"):
        budget_overrides("vanilla", 100)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="budget must be a positive integer"):
            budget_overrides("snapkv", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="did you mean 'snapkv'"):
        budget_overrides("snapvk", 100)


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "knorm", "h2o", "tova", "pyramidkv"])
def test_the_knob_bounds_what_an_eviction_method_keeps(method: str) -> None:
    """Once prefill is over, a request holds about the budget per layer (not the prompt)."""
    prompt, budget, layers = 4096, 1024, 8
    config = EngineConfig.create(sparse_method=method, **budget_overrides(method, budget))
    m = create_method(config, num_layers=layers, num_kv_heads=2)
    if method == "pyramidkv":  # the budget is the mean over layers
        mean = sum(m.layer_budget(layer) for layer in range(layers)) / layers
        assert abs(mean - budget) <= 1
        return
    interval = config.to_dict().get("h2o_decode_eviction_interval")
    slack = {"h2o": interval, "tova": 1, "streamingllm": 1}
    assert budget <= m.decode_resident(prompt, 0) <= budget + slack.get(method, 0)
