"""What a request's output must match (structured outputs), as plain data.

One constraint per request, named as in vLLM's ``StructuredOutputsParams``: ``json`` (a
JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (exactly one of
a list of strings) or ``grammar`` (Lark or GBNF). The engine compiles it with
llguidance (engine/structured.py) and masks every sampling step with it; this module
only checks the shape of the request, so that it stays importable without the engine.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
_KINDS: tuple[Kind, ...] = ("json", "json_object", "regex", "choice", "grammar")
# Bounds on what one request may ask to compile (a schema's own size is bounded by
# the server's body limit; these keep a choice list or a pattern from being absurd).
MAX_CHOICES = 1024
MAX_PATTERN_LEN = 64 * 1024


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output; give exactly one of the constraint fields.

    ``json`` is a JSON schema as a dict or as JSON text; ``choice`` a non-empty list of
    strings; ``regex`` a Rust-regex pattern the whole output must match; ``grammar`` a
    Lark (or GBNF) grammar. ``disable_any_whitespace`` makes JSON compact: no
    whitespace between tokens (vLLM's name), which keeps small models from padding
    their output with newlines.
    """

    json: str | Mapping[str, object] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        given = [k for k in _KINDS if self._given(k)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, "
                f"choice, grammar (got {what})"
            )
        self.json = _check_schema(self.json) if self.json is not None else None
        for name in ("regex", "grammar", "whitespace_pattern"):
            _check_text(name, getattr(self, name))
        if self.choice is not None:
            self.choice = _check_choice(self.choice)

    def _given(self, kind: Kind) -> bool:
        return bool(self.json_object) if kind == "json_object" else getattr(self, kind) is not None

    @property
    def kind(self) -> Kind:
        """Which constraint this is."""
        return next(k for k in _KINDS if self._given(k))

    def source(self) -> str:
        """The constraint as text: a schema as JSON (key order kept: it fixes the
        order of the output's properties), a choice list as a JSON array."""
        kind = self.kind
        if kind == "json":
            return jsonlib.dumps(self.json, ensure_ascii=False)
        if kind == "choice":
            return jsonlib.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return '{"type": "object"}'
        return str(getattr(self, kind))

    def cache_key(self) -> tuple[str, str, bool, str | None]:
        """Equal keys compile to the same grammar."""
        return self.kind, self.source(), self.disable_any_whitespace, self.whitespace_pattern


# vLLM's older name, and the name this project's docs use in prose.
StructuredOutputs = StructuredOutputsParams


def _check_schema(schema: object) -> Mapping[str, object]:
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except jsonlib.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise ValueError("structured_outputs.json must be a JSON schema object (a dict)")
    try:
        jsonlib.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json must be JSON-serialisable: {e}") from None
    return schema


def _check_text(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string")
    if len(value) > MAX_PATTERN_LEN:
        raise ValueError(f"structured_outputs.{name} must be at most {MAX_PATTERN_LEN} characters")


def _check_choice(choice: object) -> list[str]:
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise ValueError("structured_outputs.choice must be a list of strings")
    items = list(choice)
    if not items or len(items) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must list 1 to {MAX_CHOICES} strings")
    if not all(isinstance(c, str) and c for c in items):
        raise ValueError("structured_outputs.choice must contain only non-empty strings")
    return items
