"""Per-request sampling parameters (vLLM-compatible subset)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparsevllm.structured_outputs import StructuredOutputsParams

# OpenAI's documented range for presence/frequency penalties.
_PENALTY_RANGE = 2.0
# Upper bound on requested top-N logprobs; keeps the per-step top-k cheap.
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; `top_k=True` is almost certainly a bug in the caller.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Semantics follow vLLM: ``top_k`` of 0 or -1 disables top-k, ``temperature == 0``
    means greedy decoding, ``repetition_penalty`` is the HF/CTRL multiplicative
    penalty over prompt and output tokens, while ``presence_penalty`` and
    ``frequency_penalty`` are OpenAI-style additive penalties over output tokens only.
    ``logprobs`` requests the top-N alternatives per generated token (0 returns only
    the chosen token's logprob). ``structured_outputs`` constrains the output to a
    JSON schema, a regex, a choice or a grammar (a ``StructuredOutputsParams``, or a
    dict of its fields). ``stop`` is normalised to a list of strings and
    ``stop_token_ids`` to a list of ints by ``__post_init__``.

    A request may choose its KV sparsity among the methods its engine serves
    (``EngineConfig.sparse_methods``): ``sparse_method`` (None: the engine's),
    ``kv_budget`` (KV tokens per layer, sink and recent included, set through the
    method's budget knob; ``"auto"``: the smallest calibrated budget whose accuracy stays
    at or above ``min_accuracy``) and ``sparse_knobs`` (the method's settings by name,
    applied after ``kv_budget``).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    sparse_method: str | None = None
    kv_budget: int | str | None = None
    min_accuracy: float | None = None
    sparse_knobs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._validate_ints()
        self._validate_sparse()
        self._validate_floats()
        self._validate_bools()
        self._normalise_stops()
        self._normalise_structured()

    # ------------------------------------------------------------------ validation
    def _validate_ints(self) -> None:
        self.n = _require_int("n", self.n, low=1)
        self.max_tokens = _require_int("max_tokens", self.max_tokens, low=1)
        self.min_tokens = _require_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.top_k = _require_int("top_k", self.top_k, low=-1, hint="-1 or 0 disables top-k")
        if self.seed is not None:
            self.seed = _require_int("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _require_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _require_int(
                "truncate_prompt_tokens", self.truncate_prompt_tokens, low=1
            )

    def _validate_sparse(self) -> None:
        if self.sparse_method is not None and not isinstance(self.sparse_method, str):
            raise ValueError(f"sparse_method must be a method name, got {self.sparse_method!r}")
        budget = self.kv_budget
        if budget is not None and budget != "auto":
            if not _is_int(budget) or int(budget) < 1:
                raise ValueError(f"kv_budget must be a positive integer or 'auto', got {budget!r}")
            self.kv_budget = int(budget)
        if self.min_accuracy is not None:
            if budget != "auto":
                raise ValueError("min_accuracy must come with kv_budget='auto' (it is its floor)")
            self.min_accuracy = _require_float(
                "min_accuracy", self.min_accuracy, low=0.0, high=1.0, low_open=True
            )
        knobs = self.sparse_knobs
        if knobs is not None:
            if not isinstance(knobs, Mapping) or not all(isinstance(k, str) for k in knobs):
                raise ValueError(f"sparse_knobs must map setting names to values, got {knobs!r}")
            self.sparse_knobs = dict(knobs)

    def _validate_floats(self) -> None:
        self.temperature = _require_float("temperature", self.temperature, low=0.0)
        self.top_p = _require_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.min_p = _require_float("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _require_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_open=True
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_float(
                name, getattr(self, name), low=-_PENALTY_RANGE, high=_PENALTY_RANGE
            )
            setattr(self, name, value)

    def _validate_bools(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")

    def _normalise_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
        self.stop_token_ids = [_require_int("stop_token_ids", t, low=0) for t in ids]

    def _normalise_structured(self) -> None:
        spec = self.structured_outputs
        if spec is None or isinstance(spec, StructuredOutputsParams):
            return
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or a dict, got {spec!r}"
            )
        from sparsevllm.config import check_keys

        fields = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
        check_keys(spec, fields, what="structured_outputs field")
        self.structured_outputs = StructuredOutputsParams(**dict(spec))

    # ------------------------------------------------------------------ helpers
    @property
    def greedy(self) -> bool:
        """True when sampling degenerates to argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering actually restricts the vocabulary."""
        return self.top_k > 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping (e.g. a JSON request body).

        Unknown keys are rejected rather than silently ignored, with the closest
        valid field name suggested, because a misspelt ``temprature`` would
        otherwise quietly sample at the default temperature.
        """
        from sparsevllm.config import check_keys

        check_keys(d, [f.name for f in dataclasses.fields(cls)], what="sampling parameter")
        return cls(**dict(d))


def _require_int(
    name: str,
    value: Any,
    low: int | None = None,
    high: int | None = None,
    hint: str = "",
) -> int:
    """Return ``value`` as ``int``; raise ``ValueError`` naming ``name`` if out of range."""
    bounds = _describe_bounds(low, high, low_open=False)
    suffix = f" ({hint})" if hint else ""
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer{bounds}{suffix}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer{bounds}{suffix}, got {value!r}")
    return int(value)


def _require_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """Validate a finite real in the given range and return it as ``float``."""
    bounds = _describe_bounds(low, high, low_open=low_open)
    if not _is_real(value) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number{bounds}, got {value!r}")
    v = float(value)
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and v > high
    if too_low or too_high:
        raise ValueError(f"{name} must be a number{bounds}, got {value!r}")
    return v


def _describe_bounds(low: float | None, high: float | None, low_open: bool) -> str:
    """Human-readable range, e.g. ' in (0, 1]' or ' >= 0', for error messages."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" <= {high:g}"
    return ""
