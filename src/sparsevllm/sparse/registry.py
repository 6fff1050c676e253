"""Sparse-method registry: the single source of truth for method names and aliases."""

from __future__ import annotations

import difflib

# name -> one-line description. The sparse-method issue extends this table with
# families, prefill policies and knobs; until then only the dense baseline exists.
METHODS: dict[str, str] = {
    "vanilla": "dense full attention (the baseline)",
}
ALIASES: dict[str, str] = {
    "dense": "vanilla",
    "full": "vanilla",
}


def canonical_method_name(name: str) -> str:
    """Return the canonical method name for `name` or an alias; clear error otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"sparse_method must be a string, got {name!r}")
    key = name.strip().lower().replace("_", "-")
    if key in METHODS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    known = sorted(METHODS) + sorted(ALIASES)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown sparse_method {name!r}{hint} (available: {', '.join(METHODS)})")
