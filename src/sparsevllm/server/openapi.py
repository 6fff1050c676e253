"""The server's OpenAPI document, as precise as the server's own validation.

The endpoints read their bodies themselves (`app.parse_body`: one 400 shape for every
failure), so FastAPI cannot see the request models. This module puts them back: each
POST route gets its pydantic model's JSON schema as its request body (types, bounds,
required fields and `additionalProperties: false`, exactly what `parse_body` enforces),
and every route documents the errors it can answer, all in OpenAI's shape. A
schema-driven fuzzer (tests/server/test_fuzz_api.py, scripts/fuzz_api.py) generates
requests from this document and checks the answers against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from sparsevllm.server.cache import CachePruneRequest
from sparsevllm.server.protocol import (
    CHAIN_ID_HEADER,
    MAX_CHAIN_ID_LEN,
    ChatCompletionRequest,
    CompletionRequest,
)
from sparsevllm.server.responses_protocol import ResponsesRequest
from sparsevllm.server.tokenize import DetokenizeRequest, TokenizeRequest


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer: `{"error": {"message", "type", "param", "code"}}`."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


# path -> the model of its JSON body
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/cache/prune": CachePruneRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
CHAIN_ROUTES = ("/v1/completions", "/v1/chat/completions")

_ERRORS = {
    "400": "Invalid request: the message names the field (`param`)",
    "401": "Missing or incorrect API key (when the server has one)",
    "404": "Unknown model, or no such cache entry",
    "409": "The chain is being extended by another request",
    "413": "The request body is too large",
    "429": "Too many requests are waiting; retry later",
    "500": "The engine failed on this request",
    "503": "The server is shutting down",
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# One server-sent event: `data:` holds a JSON chunk, a JSON error, or `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "minLength": 1}, "event": {"const": "message"}},
}
# The Responses API names each event (`event: response.output_text.delta`, ...).
_NAMED_SSE_EVENT = {
    "type": "object",
    "required": ["data", "event"],
    "properties": {
        "data": {"type": "string", "minLength": 1},
        "event": {"type": "string", "minLength": 1},
    },
}
# path -> the schema of each event of its `stream: true` answers
STREAMING = {
    "/v1/completions": _SSE_EVENT,
    "/v1/chat/completions": _SSE_EVENT,
    "/v1/responses": _NAMED_SSE_EVENT,
}


def install_openapi(app: FastAPI, secured: bool) -> None:
    """Make `app.openapi()` return the precise document (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, secured)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI, secured: bool) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's 422s: this server answers 400
    schemas.pop("ValidationError", None)
    models = [*REQUEST_BODIES.values(), ErrorResponse]
    refs, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas.update(defs.get("$defs", {}))
    by_model = {m: refs[(m, "validation")] for m in models}
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            _describe(operation, path, method, by_model, secured)
    return doc


def _describe(
    operation: dict[str, Any],
    path: str,
    method: str,
    by_model: dict[type[BaseModel], dict[str, Any]],
    secured: bool,
) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    protected = path.startswith("/v1/") or path in REQUEST_BODIES
    model = REQUEST_BODIES.get(path) if method == "post" else None
    for status, text in _ERRORS.items():
        if status == "401" and not (secured and protected):
            continue
        if status in ("409", "413", "429", "500") and model is None:
            continue
        responses[status] = {
            "description": text,
            "content": {"application/json": {"schema": _ERROR_REF}},
        }
    if model is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": by_model[model]}},
        }
    if path in STREAMING and method == "post":
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {
            "application/json": {"schema": {"type": "object"}},
            # Before OpenAPI 3.2, an event stream's schema describes each event.
            "text/event-stream": {"schema": STREAMING[path]},
        }
    if path in CHAIN_ROUTES:
        operation.setdefault("parameters", []).append(
            {
                "name": CHAIN_ID_HEADER,
                "in": "header",
                "required": False,
                "description": "The conversation to continue (chain cache); or `chain_id`",
                "schema": {
                    "type": "string",
                    "pattern": r"^[\x21-\x7e]+$",
                    "minLength": 1,
                    "maxLength": MAX_CHAIN_ID_LEN,
                },
            }
        )
    if path == "/metrics":
        operation["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if secured and protected:
        operation["security"] = [{"bearer": []}]
