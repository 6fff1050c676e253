"""The `kv_cache_dtype` names, importable without torch (the config validates them)."""

from __future__ import annotations

import difflib

# Each names a format in kv/registry.py (which checks that the two lists agree).
FORMAT_NAMES: tuple[str, ...] = ("auto", "bfloat16", "float16", "fp8_e4m3", "int8", "int4", "int2")


def check_format_name(name: str) -> None:
    """Raise a ValueError naming the closest valid format when `name` is none."""
    if name not in FORMAT_NAMES:
        close = difflib.get_close_matches(name, FORMAT_NAMES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown kv_cache_dtype {name!r}{hint} (valid: {', '.join(FORMAT_NAMES)})"
        )
