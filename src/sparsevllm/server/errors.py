"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

# Hints for fields whose type is a union: pydantic reports one error per union member,
# which reads badly; one sentence saying what is expected reads better.
_UNION_HINTS: dict[str, str] = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...}); "
    "other content types are not supported",
}


class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(error: ValueError, default_param: str | None = None) -> APIError:
    """A 400 from a ValueError of the engine or SamplingParams.

    Their messages start with the offending field name ("max_tokens must be ..."), so
    that name becomes `param` when it looks like one.
    """
    message = str(error)
    match = re.match(r"([a-z_]+) (?:must|has)\b", message)
    return bad_request(message, param=match.group(1) if match else default_param)


def from_validation_error(error: ValidationError) -> APIError:
    """A 400 naming the first invalid field of a request body."""
    errors = error.errors(include_url=False)
    first = errors[0]
    top = first["loc"][:1]
    group = [e for e in errors if e["loc"][:1] == top]
    loc = _common_prefix([e["loc"] for e in group])
    param = ".".join(str(p) for p in loc) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field {param!r}", param=param, code="unknown_field")
    if first["type"] == "model_type" and not loc:
        return bad_request("the request body must be a JSON object")
    if first["type"] == "value_error":  # raised by a model validator: names its field
        message = first["msg"].removeprefix("Value error, ")
        match = re.match(r"([a-z_]+)\b", message)
        return bad_request(message, param=param or (match.group(1) if match else None))
    if first["type"] == "missing":
        return bad_request(f"{param}: this field is required", param=param)
    last_name = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    if len(group) > 1 and last_name in _UNION_HINTS:
        return bad_request(f"{param}: expected {_UNION_HINTS[last_name]}", param=param)
    detail = first["msg"]
    got = first.get("input")
    if isinstance(got, (int, float, bool, type(None))) or (isinstance(got, str) and len(got) < 40):
        detail += f" (got {got!r})"
    return bad_request(f"{param}: {detail}", param=param)


def _common_prefix(locs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    # A union member's name ("str", "list[int]") is not part of the field's path.
    while prefix and isinstance(prefix[-1], str) and re.search(r"[\[\]]|^(str|int)$", prefix[-1]):
        prefix = prefix[:-1]
    return prefix
