"""What the structured-output tests share: a small JSON schema and an exact check of it
(no jsonschema dependency: the check says precisely what the schema allows)."""

from __future__ import annotations

import json
from typing import Any

ROLES = ["admin", "user", "guest"]
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ROLES},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def person_problem(text: str | None) -> str | None:
    """Why `text` is not a JSON document valid against PERSON (None: it is)."""
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError as e:
        return f"not JSON ({e}): {text!r}"
    if not isinstance(value, dict) or set(value) != {"name", "age", "role"}:
        return f"not an object with exactly name, age and role: {text!r}"
    name, age = value["name"], value["age"]
    if not isinstance(name, str) or len(name) > 12:
        return f"name is not a string of at most 12 characters: {text!r}"
    if not isinstance(age, int) or isinstance(age, bool) or not 0 <= age <= 120:
        return f"age is not an integer in [0, 120]: {text!r}"
    if value["role"] not in ROLES:
        return f"role is not one of {ROLES}: {text!r}"
    return None
