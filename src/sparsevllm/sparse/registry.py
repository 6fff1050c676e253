"""Sparse-method registry: method names and aliases -> the module that defines them.

A method module exposes `SPEC` (a `MethodSpec`: its knobs, family, policies, class).
Built-in methods are listed here by module path; other packages add theirs with
`register_method(spec)` or an entry point in the `sparsevllm.sparse_methods` group
(`name = "package.module"`, a module with a `SPEC`). Name resolution is torch-free;
a method's module is imported the first time its spec is asked for.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, TypeVar

from sparsevllm.kv.layout import GQA, LAYOUT_NAMES
from sparsevllm.kv.names import FORMAT_NAMES
from sparsevllm.sparse.spec import (
    PREFILL_POLICIES,
    SHARED_DEFAULTS,
    MethodKnobs,
    MethodSpec,
    SettingValue,
)

if TYPE_CHECKING:
    from sparsevllm.sparse.base import MethodSettings, SparseMethod

T = TypeVar("T")

ENTRY_POINT_GROUP = "sparsevllm.sparse_methods"
_M = "sparsevllm.sparse."
_MODULES: dict[str, str] = {
    name: _M + name
    for name in (
        "vanilla",
        "streamingllm",
        "snapkv",
        "pyramidkv",
        "adakv",
        "duoattention",
        "h2o",
        "rkv",
        "tova",
        "knorm",
        "keydiff",
        "lagkv",
        "strided",
        "expected_attention",
        "kvzip",
        "omnikv",
        "quest",
        "deltakv",
    )
}
_ALIASES: dict[str, str] = {
    "dense": "vanilla",
    "full": "vanilla",
    "attention-sink": "streamingllm",
    "attention_sink": "streamingllm",
    "streaming": "streamingllm",
    "pyramid": "pyramidkv",
    "heavy-hitter": "h2o",
}
_SPECS: dict[str, MethodSpec] = {}  # loaded or registered specs, by canonical name
_entry_points_loaded = False


def register_method(spec: MethodSpec, aliases: tuple[str, ...] = ()) -> None:
    """Make `spec` available by its name (and aliases) to every entry point: `LLM`,
    JSON configs, CLI flags, `sparsevllm methods`. Re-registering a name replaces it."""
    taken = set(_MODULES) | set(_ALIASES) | set(_SPECS)
    for alias in aliases:
        if alias in taken and _ALIASES.get(alias) != spec.name:
            raise ValueError(f"alias {alias!r} already names a method")
    _SPECS[spec.name] = spec
    _ALIASES.update(dict.fromkeys(aliases, spec.name))


def unregister_method(name: str) -> None:
    """Remove a method added with `register_method` (built-in methods stay)."""
    if name in _MODULES:
        raise ValueError(f"{name} is a built-in method")
    _SPECS.pop(name, None)
    for alias in [a for a, target in _ALIASES.items() if target == name]:
        del _ALIASES[alias]


def method_names() -> list[str]:
    """Canonical names of every available method, built-ins first."""
    _load_entry_points()
    return list(_MODULES) + [name for name in _SPECS if name not in _MODULES]


def canonical_method_name(name: object) -> str:
    """Return the canonical method name for `name` or an alias; clear error otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"sparse_method must be a string, got {name!r}")
    key = name.strip().lower()
    names = method_names()
    if key in names:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    close = difflib.get_close_matches(key, names + sorted(_ALIASES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown sparse_method {name!r}{hint} (available: {', '.join(names)})")


def method_spec(name: str) -> MethodSpec:
    key = canonical_method_name(name)
    if key not in _SPECS:
        _SPECS[key] = _spec_of_module(_MODULES[key], key)
    return _SPECS[key]


def all_specs() -> list[MethodSpec]:
    return [method_spec(name) for name in method_names()]


def aliases_of(name: str) -> list[str]:
    return sorted(a for a, target in _ALIASES.items() if target == name)


def _spec_of_module(module: str, name: str) -> MethodSpec:
    spec = getattr(importlib.import_module(module), "SPEC", None)
    if not isinstance(spec, MethodSpec) or spec.name != name:
        raise ValueError(f"module {module} defines no MethodSpec named {name!r} as SPEC")
    return spec


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _MODULES and ep.name not in _SPECS:
            register_method(_spec_of_module(ep.value, ep.name))


def knob_owners(name: str) -> list[str]:
    """The methods that have a knob called `name`."""
    return [s.name for s in all_specs() if name in s.knobs.names()]


def all_knob_names() -> list[str]:
    names: dict[str, None] = {}
    for spec in all_specs():
        names.update(dict.fromkeys(spec.knobs.names()))
    return list(names)


def drop_foreign_knobs(method: str, values: Mapping[str, T]) -> dict[str, T]:
    """`values` without the knobs of other methods: settings shared by runs of several
    methods (a quality grid's config file) apply to each method as far as they can."""
    own = set(method_spec(method).knobs.names())
    foreign = set(all_knob_names()) - own
    return {k: v for k, v in values.items() if k not in foreign}


def resolve_prefill_policy(method: str, explicit: str | None) -> str:
    """The method's policy; an explicit contradicting choice fails fast."""
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
    method: str, budget: int, shared_defaults: Mapping[str, SettingValue] | None = None
) -> dict[str, int]:
    """Settings that give `method` a KV budget of `budget` tokens per layer.

    The method's `budget_knob` gets the budget; for streamingllm, whose budget knob is
    `recent_keep_tokens`, that is `budget - sink_keep_tokens`. `decode_keep_tokens` (the
    config's generic "KV budget per layer") is set to the budget too, so the config's
    `sink + recent <= decode_keep_tokens` check holds for every method. Sink and recent
    come from `shared_defaults` (default: the engine's defaults), clamped so that together they
    never exceed the budget; at least one recent token stays when the budget is tiny.
    PyramidKV reads the budget as its mean over layers; OmniKV's full-attention layers
    and Quest's first `quest_skip_layers` layers read the whole context by design.
    """
    spec = method_spec(method)
    if spec.budget_knob is None:
        raise ValueError(f"{spec.name} keeps the whole context: it has no KV budget knob")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive integer, got {budget!r}")
    if shared_defaults is None:
        shared_defaults = SHARED_DEFAULTS
    sink = min(_count(shared_defaults, "sink_keep_tokens"), budget - 1)
    if spec.budget_knob == "recent_keep_tokens":
        recent = budget - sink
    else:
        recent = min(_count(shared_defaults, "recent_keep_tokens"), budget - sink)
    overrides = {
        "sink_keep_tokens": sink,
        "recent_keep_tokens": recent,
        "decode_keep_tokens": budget,
    }
    overrides.setdefault(spec.budget_knob, budget)
    return overrides


def _count(settings: Mapping[str, SettingValue], name: str) -> int:
    value = settings[name]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number of tokens, got {value!r}")
    return int(value)


def create_method(
    config: MethodSettings,
    num_layers: int,
    num_kv_heads: int,
    layers: list[int] | None = None,
    slot_layout: str = GQA,
) -> SparseMethod:
    """Instantiate the configured method over `layers` (default: every layer) of a model
    whose slots have layout `slot_layout` (kv/layout.py)."""
    spec = method_spec(config.sparse_method)
    check_slot_layout(spec, slot_layout)
    return spec.method(config, num_layers, num_kv_heads, layers)


def check_slot_layout(spec: MethodSpec, slot_layout: str) -> None:
    """Raise a ValueError with the method's reason when it cannot serve `slot_layout`."""
    reason = spec.refused_layouts.get(slot_layout)
    if reason is None:
        return
    usable = [s.name for s in all_specs() if slot_layout not in s.refused_layouts]
    raise ValueError(
        f"sparse_method {spec.name!r} cannot serve this model's {slot_layout} KV cache: "
        f"{reason} (methods that can: {', '.join(usable)})"
    )


def methods_table() -> list[dict[str, object]]:
    """Rows for `sparsevllm methods` (text or JSON)."""
    rows: list[dict[str, object]] = []
    for s in all_specs():
        knobs: dict[str, object] = {k: SHARED_DEFAULTS[k] for k in s.budget_fields}
        knobs.update(s.knobs.defaults())
        rows.append(
            {
                "name": s.name,
                "family": s.family,
                "prefill_policy": s.prefill_policy,
                "bounded_prefill": s.bounded_prefill,
                "aliases": aliases_of(s.name),
                "knobs": knobs,
                "budget_knob": s.budget_knob,
                "prefix_cache": s.prefix_cache,
                "chain_cache": s.chain_cache,
                "decode_views": s.decode_views.value,
                "prune": s.prune_scorer is not None,
                "kv_formats": list(FORMAT_NAMES if s.kv_formats is None else s.kv_formats),
                "slot_layouts": [n for n in LAYOUT_NAMES if n not in s.refused_layouts],
                "description": s.description,
            }
        )
    return rows


def validate_knobs(method: str, values: Mapping[str, object]) -> MethodKnobs:
    """The method's knobs dataclass from `values`; a knob of another method, or an
    unknown one, fails with a message naming the owner or the closest valid name."""
    spec = method_spec(method)
    for key in values:
        if key in spec.knobs.names():
            continue
        owners = knob_owners(key)
        if owners:
            raise ValueError(
                f"{key} is a knob of {', '.join(owners)}, not of sparse_method {spec.name!r}"
                f" (its knobs: {', '.join(spec.knobs.names()) or 'none'})"
            )
    return spec.knobs.from_mapping(values, spec.name)
