"""What a method declares about itself: its knobs (a frozen dataclass) and its spec.

A method module defines both beside its code:

    @dataclass(frozen=True)
    class MyKnobs(MethodKnobs):
        my_window: int = knob(32, "Queries that vote.", minimum=1)

    SPEC = MethodSpec(name="mine", family="physical_eviction", method=Mine, knobs=MyKnobs,
                      description="...", budget_knob="decode_keep_tokens", chain_cache=True)

Knob names are global (they are `LLM(...)` keyword arguments, JSON keys and CLI flags
next to the engine's own settings), so a method prefixes its own (`snapkv_window_size`);
methods that share a scoring rule may share a knobs class (PyramidKV extends SnapKV's).
Torch-free: validation is plain Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar, Union, cast

from sparsevllm.kv.layout import LAYOUT_NAMES

if TYPE_CHECKING:
    import torch

    from sparsevllm.sparse.base import SparseMethod

T = TypeVar("T")

# A setting's value once validated (engine settings and method knobs alike); the JSON and
# CLI forms, e.g. a list or a comma-separated string for a tuple, are converted first.
SettingValue: TypeAlias = int | float | bool | str | tuple[int, ...] | None

FAMILIES = (
    "dense",
    "physical_eviction",
    "logical_masking",
    "query_aware_selection",
    "compression",
)
PREFILL_POLICIES = ("all_chunked", "long_bs1full_short_batch")
# Engine settings every budgeted method reads (EngineConfig fields, shared by methods).
SHARED_DEFAULTS: dict[str, int] = {
    "sink_keep_tokens": 4,
    "recent_keep_tokens": 32,
    "decode_keep_tokens": 2048,
}
SHARED_BUDGET = tuple(SHARED_DEFAULTS)


class DecodeViews(enum.Enum):
    """How a method narrows what a decode query reads (`SparseMethod.select_views`), and
    so whether its decode steps can replay a captured CUDA graph."""

    # Every decode query reads its whole view; decode graphs replay as for dense
    # attention (when no row of the step asks for scores).
    NONE = "none"
    # select_views narrows decode reads with host data of the step: decode steps run
    # eagerly, outside CUDA graphs.
    EAGER = "eager"
    # select_views reads only device tensors of fixed shapes (allocated by
    # prepare_graph_capture, replaced only with a new graph_epoch) plus the batch's
    # device metadata, never host lists: decode graphs compute the views themselves
    # (and serve the decode rows' score requests).
    GRAPH = "graph"


def knob(
    default: T,
    help: str,  # noqa: A002 (the argparse word)
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> T:
    """A knob field: its default, its help text (CLI and `sparsevllm methods`) and
    inclusive bounds checked at construction."""
    bounds = {"minimum": minimum, "maximum": maximum}
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


@dataclass(frozen=True)
class MethodKnobs:
    """Base of every method's knobs dataclass: validates types and bounds once.

    A subclass adds fields made with `knob(...)` and may extend `__post_init__` for
    checks across its knobs (call super first)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            low = f.metadata.get("minimum")
            if low is not None and value is not None and value < low:
                raise ValueError(f"{f.name} must be >= {low}, got {value}")
            high = f.metadata.get("maximum")
            if high is not None and value is not None and value > high:
                raise ValueError(f"{f.name} must be <= {high}, got {value}")
            object.__setattr__(self, f.name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def help(cls, name: str) -> str:
        return str(next(f for f in dataclasses.fields(cls) if f.name == name).metadata["help"])

    @classmethod
    def type_of(cls, name: str) -> type[object]:
        """The knob's value type without Optional (`int`, `float`, `bool`, `str`, `tuple`)."""
        return base_type(typing.get_type_hints(cls)[name])

    @classmethod
    def defaults(cls) -> dict[str, SettingValue]:
        fields = dataclasses.fields(cls)
        return {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], method: str) -> MethodKnobs:
        """Validate `values` (a subset of the knobs); unknown names fail with the closest."""
        for key in values:
            if key not in cls.names():
                close = difflib.get_close_matches(key, cls.names(), n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                valid = ", ".join(cls.names()) or "none"
                raise ValueError(f"unknown knob {key!r} of {method}{hint} (its knobs: {valid})")
        return cls(**values)

    def values(self) -> dict[str, SettingValue]:
        return {name: getattr(self, name) for name in self.names()}


@dataclass(frozen=True)
class NoKnobs(MethodKnobs):
    """For methods without knobs of their own."""


# Scores a cached history's entries for pruning: (keys `[L, Hkv, D]`, logical positions
# `[Hkv, L]`, the scoring method's knobs) -> `[Hkv, L]` float32 importance (higher kept).
PruneScorer: TypeAlias = Callable[["torch.Tensor", "torch.Tensor", MethodKnobs], "torch.Tensor"]


@dataclass(frozen=True)
class MethodSpec:
    """What the host asks a method about before it runs one (never which method it is).

    - `family`: one of FAMILIES, for listings and docs.
    - `prefill_policy`: the default prefill policy (an explicit contradicting one fails).
    - `budget_fields`: the shared EngineConfig budget settings the method reads.
    - `budget_knob`: the setting (shared or the method's own) that bounds the tokens a
      layer keeps or reads, sink and recent included; None: the full context is kept.
    - `prefix_cache`: storage stays a plain prefix, so radix reuse is exact.
    - `chain_cache`: evicted state can continue a conversation (the chain cache).
    - `prune_scorer`: how the method scores a cached history's tokens when it serves
      as the scorer of `LLM.prune` (None: it cannot).
    - `prunable`: whether a history the method holds may be pruned at all (False: its
      storage needs every token in position order, e.g. DeltaKV's references).
    - `kv_formats`: the `kv_cache_dtype` names whose storage the method can serve
      (None: every format; a method that reads stored bytes itself would list its own).
    - `refused_layouts`: slot layouts (kv/layout.py: `gqa`, `mla_latent`) the method cannot
      serve, each with the reason; the engine refuses the method on such a model.

    How the method uses decode views (`decode_views`) and whether it can bound a prompt's
    prefill memory (`bounded_prefill`) are read from its class, which declares them beside
    the hooks they describe.
    """

    name: str
    family: str
    description: str
    method: type[SparseMethod]
    knobs: type[MethodKnobs] = NoKnobs
    budget_fields: tuple[str, ...] = ()
    budget_knob: str | None = None
    prefill_policy: str = "all_chunked"
    prefix_cache: bool = False
    chain_cache: bool = False
    prune_scorer: PruneScorer | None = None
    prunable: bool = True
    kv_formats: tuple[str, ...] | None = None
    refused_layouts: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(
                f"prefill_policy must be one of {', '.join(PREFILL_POLICIES)}, "
                f"got {self.prefill_policy!r}"
            )
        unknown = set(self.budget_fields) - set(SHARED_BUDGET)
        if unknown:
            raise ValueError(f"budget_fields must be among {SHARED_BUDGET}, got {sorted(unknown)}")
        unknown_layouts = set(self.refused_layouts) - set(LAYOUT_NAMES)
        if unknown_layouts:
            raise ValueError(f"refused_layouts must be among {LAYOUT_NAMES}, got {unknown_layouts}")
        own = (*self.budget_fields, *self.knobs.names())
        if self.budget_knob is not None and self.budget_knob not in own:
            raise ValueError(f"budget_knob {self.budget_knob!r} is none of {self.name}'s settings")

    @property
    def decode_views(self) -> DecodeViews:
        """`SparseMethod.decode_views` of the method's class."""
        return self.method.decode_views

    @property
    def bounded_prefill(self) -> bool:
        """`SparseMethod.bounded_prefill` of the method's class: it can compact between
        prompt chunks (EngineConfig.bounded_prefill)."""
        return self.method.bounded_prefill

    @property
    def settings(self) -> tuple[str, ...]:
        """Every setting the method reads: shared budget fields, then its own knobs."""
        return (*self.budget_fields, *self.knobs.names())


def base_type(hint: object) -> type[object]:
    """The class of a setting's annotation without Optional: `int | None` -> int,
    `tuple[int, ...]` -> tuple."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    kind = typing.get_origin(hint) or hint
    if not isinstance(kind, type):
        raise TypeError(f"a setting's annotation must be one class or Optional of it, got {hint}")
    return kind


def _coerce(name: str, value: object, hint: object) -> SettingValue:
    """Check `value` against the knob's annotation; JSON and CLI forms are converted
    (an int where a float belongs, a comma-separated string or a list for a tuple)."""
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} must be set, got None")
    kind = base_type(hint)
    if kind is tuple:
        return _coerce_tuple(name, value)
    if isinstance(value, bool) and kind is not bool:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise ValueError(f"{name} has the wrong type: got {type(value).__name__} {value!r}")
    return cast(SettingValue, value)  # an instance of the knob's own (setting) type


def _coerce_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str):
        try:
            value = [int(x) for x in value.replace(" ", "").split(",") if x]
        except ValueError:
            raise ValueError(f"{name} must be comma-separated integers, got {value!r}") from None
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise ValueError(f"{name} must be non-negative integers, got {value!r}")
    return tuple(sorted(set(value)))
