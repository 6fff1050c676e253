"""Sparse-method registry: the single source of truth for method names, aliases,
families, default prefill policies and knobs. Torch-free (the config imports it);
method classes are imported lazily by `create_method`."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparsevllm.config import EngineConfig
    from sparsevllm.sparse.base import SparseMethod

PREFILL_POLICIES = ("all_chunked", "long_bs1full_short_batch")
FAMILIES = ("dense", "physical_eviction", "logical_masking", "query_aware_selection")
_BUDGET = ("sink_keep_tokens", "recent_keep_tokens", "decode_keep_tokens")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str
    target: str  # "module:Class"
    description: str
    knobs: tuple[str, ...] = ()
    prefill_policy: str = "all_chunked"
    prefix_cache: bool = False  # storage stays a plain prefix: radix reuse is exact
    chain_cache: bool = False  # evicted state can continue a conversation
    # The EngineConfig field that bounds the tokens a layer keeps (eviction) or reads
    # (selection), sink and recent included; None: the method keeps the full context.
    # See `budget_overrides`.
    budget_knob: str | None = None


_M = "sparsevllm.sparse."
METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in [
        MethodSpec(
            "vanilla",
            "dense",
            _M + "vanilla:Vanilla",
            "full attention, the baseline",
            prefix_cache=True,
        ),
        MethodSpec(
            "streamingllm",
            "physical_eviction",
            _M + "streamingllm:StreamingLLM",
            "keep attention sinks + a recent window; evict the rest in prefill and decode",
            ("sink_keep_tokens", "recent_keep_tokens"),
            budget_knob="recent_keep_tokens",
            chain_cache=True,
        ),
        MethodSpec(
            "snapkv",
            "physical_eviction",
            _M + "snapkv:SnapKV",
            "at prefill end keep sink + recent + the tokens the last prompt queries "
            "attend to most, per KV head",
            (*_BUDGET, "snapkv_window_size", "snapkv_pool_kernel_size"),
            budget_knob="decode_keep_tokens",
            chain_cache=True,
        ),
        MethodSpec(
            "pyramidkv",
            "physical_eviction",
            _M + "pyramidkv:PyramidKV",
            "SnapKV scoring with budgets shrinking from lower to upper layers",
            (*_BUDGET, "snapkv_window_size", "snapkv_pool_kernel_size", "pyramidkv_beta"),
            budget_knob="decode_keep_tokens",
            prefill_policy="long_bs1full_short_batch",
            chain_cache=True,
        ),
        MethodSpec(
            "h2o",
            "physical_eviction",
            _M + "h2o:H2O",
            "heavy hitters by cumulative attention + recent tokens, evicted in bursts",
            (
                "sink_keep_tokens",
                "recent_keep_tokens",
                "h2o_decode_budget",
                "h2o_decode_eviction_interval",
            ),
            budget_knob="h2o_decode_budget",
            chain_cache=True,
        ),
        MethodSpec(
            "tova",
            "physical_eviction",
            _M + "tova:TOVA",
            "evict the tokens the current query attends to least (head average)",
            ("decode_keep_tokens",),
            budget_knob="decode_keep_tokens",
            chain_cache=True,
        ),
        MethodSpec(
            "knorm",
            "physical_eviction",
            _M + "knorm:KNorm",
            "keep the keys with the lowest L2 norm (query-agnostic), per KV head",
            _BUDGET,
            budget_knob="decode_keep_tokens",
            chain_cache=True,
        ),
        MethodSpec(
            "omnikv",
            "logical_masking",
            _M + "omnikv:OmniKV",
            "dense storage; full-attention layers pick the tokens later layers read",
            ("decode_keep_tokens", "full_attention_layers"),
            budget_knob="decode_keep_tokens",
            prefix_cache=True,
        ),
        MethodSpec(
            "quest",
            "query_aware_selection",
            _M + "quest:Quest",
            "page min/max keys; decode reads only the pages the query scores highest",
            ("decode_keep_tokens", "quest_chunk_size", "quest_skip_layers"),
            budget_knob="decode_keep_tokens",
            prefix_cache=True,
        ),
    ]
}
ALIASES: dict[str, str] = {
    "dense": "vanilla",
    "full": "vanilla",
    "attention-sink": "streamingllm",
    "attention_sink": "streamingllm",
    "streaming": "streamingllm",
    "pyramid": "pyramidkv",
    "heavy-hitter": "h2o",
}


def canonical_method_name(name: str) -> str:
    """Return the canonical method name for `name` or an alias; clear error otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"sparse_method must be a string, got {name!r}")
    key = name.strip().lower()
    if key in METHODS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    known = sorted(METHODS) + sorted(ALIASES)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown sparse_method {name!r}{hint} (available: {', '.join(METHODS)})")


def method_spec(name: str) -> MethodSpec:
    return METHODS[canonical_method_name(name)]


def method_knobs(name: str) -> tuple[str, ...]:
    return method_spec(name).knobs


def resolve_prefill_policy(method: str, explicit: str | None) -> str:
    """The registry's policy for `method`; an explicit contradicting choice fails fast."""
    default = method_spec(method).prefill_policy
    if explicit is None:
        return default
    if explicit not in PREFILL_POLICIES:
        raise ValueError(
            f"prefill_policy must be one of {', '.join(PREFILL_POLICIES)}, got {explicit!r}"
        )
    if explicit != default:
        raise ValueError(
            f"prefill_policy {explicit!r} contradicts the registry: {method} uses {default!r}"
        )
    return explicit


def budget_overrides(
    method: str, budget: int, config_defaults: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """EngineConfig overrides that give `method` a KV budget of `budget` tokens per layer.

    The method's `budget_knob` gets the budget; for streamingllm, whose budget knob is
    `recent_keep_tokens`, that is `budget - sink_keep_tokens`. `decode_keep_tokens` (the
    config's generic "KV budget per layer") is set to the budget too, so the config's
    `sink + recent <= decode_keep_tokens` check holds for every method. Sink and recent
    come from `config_defaults` (default: EngineConfig's), clamped so that together they
    never exceed the budget; at least one recent token stays when the budget is tiny.
    PyramidKV reads the budget as its mean over layers; OmniKV's full-attention layers
    and Quest's first `quest_skip_layers` layers read the whole context by design.
    """
    spec = method_spec(method)
    if spec.budget_knob is None:
        raise ValueError(f"{spec.name} keeps the whole context: it has no KV budget knob")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive integer, got {budget!r}")
    if config_defaults is None:
        from sparsevllm.config import EngineConfig

        config_defaults = EngineConfig.knob_defaults()
    sink = min(int(config_defaults["sink_keep_tokens"]), budget - 1)
    if spec.budget_knob == "recent_keep_tokens":
        recent = budget - sink
    else:
        recent = min(int(config_defaults["recent_keep_tokens"]), budget - sink)
    overrides = {
        "sink_keep_tokens": sink,
        "recent_keep_tokens": recent,
        "decode_keep_tokens": budget,
    }
    overrides.setdefault(spec.budget_knob, budget)
    return overrides


def create_method(
    config: EngineConfig,
    num_layers: int,
    num_kv_heads: int,
    layers: list[int] | None = None,
) -> SparseMethod:
    """Instantiate the configured method over `layers` (default: every layer)."""
    module, cls = method_spec(config.sparse_method).target.split(":")
    return getattr(importlib.import_module(module), cls)(config, num_layers, num_kv_heads, layers)


def methods_table() -> list[dict[str, object]]:
    """Rows for `sparsevllm methods` (text or JSON)."""
    from sparsevllm.config import EngineConfig

    defaults = EngineConfig.knob_defaults()
    return [
        {
            "name": s.name,
            "family": s.family,
            "prefill_policy": s.prefill_policy,
            "aliases": sorted(a for a, t in ALIASES.items() if t == s.name),
            "knobs": {k: defaults[k] for k in s.knobs},
            "budget_knob": s.budget_knob,
            "prefix_cache": s.prefix_cache,
            "chain_cache": s.chain_cache,
            "description": s.description,
        }
        for s in METHODS.values()
    ]
