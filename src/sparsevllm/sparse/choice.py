"""A request's sparse method: which method, with which budget settings and knobs.

An engine serves a fixed set of methods (`EngineConfig.sparse_methods`); each request
may pick one of them and override its settings (the shared budget fields it reads and
its own knobs) or give a KV budget in tokens. `resolve_choice` turns such a request into
a `MethodChoice`, validated once: the engine keeps one method instance per distinct
choice (`MethodChoice.key`), and sequences of different choices share a batch.

Torch-free: the scheduler and the prefix stores read a sequence's choice.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from sparsevllm.sparse.registry import budget_overrides, canonical_method_name, method_spec
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, SettingValue

# The shared budget settings' lower bounds (EngineConfig checks the same).
SHARED_MINIMUM = {"sink_keep_tokens": 0, "recent_keep_tokens": 0, "decode_keep_tokens": 1}


class ChoiceError(ValueError):
    """A request's method choice is invalid; `param` names the request field (the
    server's 400 reports it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class MethodChoice:
    """One method with all of its settings (what `SparseMethod` reads as its config:
    this implements `MethodSettings`)."""

    sparse_method: str
    sink_keep_tokens: int
    recent_keep_tokens: int
    decode_keep_tokens: int
    chunk_prefill_size: int
    method_knobs: MethodKnobs

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.sparse_method)

    def settings(self) -> dict[str, SettingValue]:
        """The settings the method reads: its shared budget fields, then its knobs."""
        shared = {name: getattr(self, name) for name in self.spec.budget_fields}
        return {**shared, **self.method_knobs.values()}

    @property
    def key(self) -> str:
        """Identifies the choice (canonical JSON, `choice_from_key` reads it back): equal
        keys mean one method instance serves both."""
        return json.dumps([self.sparse_method, self.settings()], sort_keys=True)

    @property
    def label(self) -> str:
        """For messages and listings: `snapkv(decode_keep_tokens=512, ...)`."""
        args = ", ".join(f"{k}={v}" for k, v in self.settings().items())
        return f"{self.sparse_method}({args})"

    @property
    def solo_prefill(self) -> bool:
        """Whether a long prompt of this method prefills alone (its prefill policy)."""
        return self.spec.prefill_policy == "long_bs1full_short_batch"


def resolve_choice(
    defaults: Mapping[str, MethodChoice],
    default_method: str,
    method: str | None = None,
    settings: Mapping[str, object] | None = None,
    kv_budget: int | None = None,
) -> MethodChoice:
    """A request's choice among the served methods (`defaults`: each served method with
    the engine's settings). `settings` override the method's shared budget fields and
    knobs; `kv_budget` (tokens per layer) sets the method's budget knob, as `bench
    quality` does (`budget_overrides`), before `settings` apply. ValueError names the
    problem: an unknown or unserved method, a setting the method does not read."""
    try:
        name = default_method if method is None else canonical_method_name(method)
    except ValueError as e:
        raise ChoiceError(str(e), "sparse_method") from None
    if name not in defaults:
        more = ",".join([n for n in defaults if n != default_method] + [name])
        raise ChoiceError(
            f"sparse_method {name!r} is not served by this engine (it serves "
            f"{', '.join(defaults)}); start the engine with it among sparse_methods "
            f"(--sparse-methods {more})",
            "sparse_method",
        )
    base = defaults[name]
    spec = base.spec
    values: dict[str, object] = dict(base.settings())
    if kv_budget is not None:
        shared = {k: getattr(base, k) for k in SHARED_BUDGET}
        try:
            budget = budget_overrides(name, kv_budget, shared)
        except ValueError as e:
            raise ChoiceError(str(e), "kv_budget") from None
        values.update({k: v for k, v in budget.items() if k in spec.settings})
    for key, value in (settings or {}).items():
        if key not in spec.settings:
            raise ChoiceError(_unknown_setting(key, spec), "sparse_knobs")
        values[key] = value
    try:
        return _build(base, values)
    except ValueError as e:
        raise ChoiceError(str(e), "sparse_knobs") from None


def choice_from_key(
    defaults: Mapping[str, MethodChoice], default_method: str, key: str
) -> MethodChoice:
    """The choice `MethodChoice.key` names (e.g. saved with a chain in the disk tier);
    ValueError if this engine does not serve it."""
    try:
        name, settings = json.loads(key)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not a sparse-method choice: {key!r}") from e
    if not isinstance(name, str) or not isinstance(settings, dict):
        raise ValueError(f"not a sparse-method choice: {key!r}")
    return resolve_choice(defaults, default_method, name, settings)


def _build(base: MethodChoice, values: Mapping[str, object]) -> MethodChoice:
    spec = base.spec
    shared: dict[str, int] = {}
    for name in SHARED_BUDGET:
        value = values.get(name, getattr(base, name))
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer number of tokens, got {value!r}")
        if value < SHARED_MINIMUM[name]:
            raise ValueError(f"{name} must be >= {SHARED_MINIMUM[name]}, got {value}")
        shared[name] = value
    # Only a method that reads all three has to keep sink + recent within the budget.
    reads_all = set(SHARED_BUDGET) <= set(spec.budget_fields)
    over = shared["sink_keep_tokens"] + shared["recent_keep_tokens"] > shared["decode_keep_tokens"]
    if reads_all and over:
        raise ValueError(
            f"sink_keep_tokens + recent_keep_tokens ({shared['sink_keep_tokens']} + "
            f"{shared['recent_keep_tokens']}) must not exceed decode_keep_tokens "
            f"({shared['decode_keep_tokens']})"
        )
    own = {k: v for k, v in values.items() if k in spec.knobs.names()}
    return MethodChoice(
        sparse_method=spec.name,
        chunk_prefill_size=base.chunk_prefill_size,
        method_knobs=spec.knobs.from_mapping(own, spec.name),
        **shared,
    )


def _unknown_setting(key: str, spec: MethodSpec) -> str:
    valid = list(spec.settings)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown setting {key!r} for sparse_method {spec.name!r}{hint} "
        f"(its settings: {', '.join(valid) or 'none'})"
    )
