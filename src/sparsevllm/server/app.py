"""The FastAPI application: routes, authentication, body limits, error shapes."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sparsevllm.server.async_engine import AsyncEngine, EngineClosed
from sparsevllm.server.cache import CachePruneRequest, cache_listing, prune_cache
from sparsevllm.server.chat import create_chat_completion
from sparsevllm.server.completions import create_completion
from sparsevllm.server.defaults import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_MAX_STORED_RESPONSES,
)
from sparsevllm.server.errors import APIError, bad_request, from_validation_error
from sparsevllm.server.metrics import CONTENT_TYPE
from sparsevllm.server.openapi import install_openapi
from sparsevllm.server.protocol import ChatCompletionRequest, CompletionRequest
from sparsevllm.server.reasoning import get_reasoning_parser
from sparsevllm.server.response_store import ResponseStore
from sparsevllm.server.responses import create_response, delete_response, get_response
from sparsevllm.server.responses_protocol import ResponsesRequest
from sparsevllm.server.serving import ServingContext
from sparsevllm.server.tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    version,
)
from sparsevllm.server.tool_parsers import get_tool_parser

logger = logging.getLogger(__name__)

_Model = TypeVar("_Model", bound=BaseModel)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413 before they fill memory.

    A declared Content-Length is checked up front; a chunked body is counted as it
    arrives and the endpoint's body read fails once it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _too_large(self.max_bytes).response()(scope, receive, send)
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise _BodyTooLarge()
            return message

        await self.app(scope, counting_receive, send)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[_Model]) -> _Model:
    """Read and validate a JSON body; every failure is a 400 that names the field."""
    body = await request.body()
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
    response_id_prefix: str = "",
) -> FastAPI:
    """The OpenAI-compatible app over `async_engine` (its worker starts with the app).

    `api_key` (if set) is required as `Authorization: Bearer KEY` on /v1 routes;
    `max_queue_len` bounds the requests waiting for the engine (beyond it: 429);
    `max_stored_responses` is how many /v1/responses results are kept for GET and
    `previous_response_id` (oldest dropped first); `reasoning_parser` (server/reasoning.py)
    splits replies' `<think>` text into `reasoning_content` and reasoning items;
    `tool_call_parser` (server/tool_parsers.py) finds the tool calls of replies;
    `response_id_prefix` follows `resp_` in response ids (a replica's name, so that a
    router can tell which replica stores a `previous_response_id`).
    """
    reasoning = get_reasoning_parser(reasoning_parser)
    tools = get_tool_parser(tool_call_parser)
    ctx = ServingContext(async_engine, served_model_name, max_queue_len, reasoning, tools)
    ctx.response_id_prefix = response_id_prefix
    responses = ResponseStore(max_stored_responses)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (max_model_len %d)", served_model_name, ctx.max_model_len)
        yield
        # Uvicorn has waited for open connections; what still runs is aborted now.
        await asyncio.to_thread(async_engine.stop)
        ctx.close()

    app = FastAPI(title="Sparse-vLLM", summary="OpenAI-compatible API", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    _add_error_handlers(app, max_body_bytes)
    require_key = _key_check(api_key)
    app.include_router(_v1_router(ctx, require_key))
    app.include_router(_responses_router(ctx, responses, require_key))
    app.include_router(_tokenizer_router(ctx, require_key))
    _add_ops_routes(app, ctx)
    install_openapi(app, secured=api_key is not None)
    return app


def _key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The dependency that requires `Authorization: Bearer KEY` (nothing without a key)."""

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return require_key


def _tokenizer_router(
    ctx: ServingContext, require_key: Callable[[Request], Awaitable[None]]
) -> APIRouter:
    """vLLM's /tokenize and /detokenize: outside /v1, but behind the key like /v1."""
    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await tokenize(ctx, await parse_body(request, TokenizeRequest))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, str]:
        return await detokenize(ctx, await parse_body(request, DetokenizeRequest))

    return router


def _v1_router(ctx: ServingContext, require_key: Callable[[Request], Awaitable[None]]) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @router.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx)]}

    @router.get("/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return _model_card(ctx)

    @router.get("/cache")
    async def cache() -> dict[str, Any]:
        try:
            return await ctx.engine.call(cache_listing)
        except EngineClosed as e:
            raise APIError(503, str(e), type="service_unavailable") from None

    @router.post("/cache/prune")
    async def cache_prune(request: Request) -> dict[str, Any]:
        return await prune_cache(ctx, await parse_body(request, CachePruneRequest))

    @router.post("/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, await parse_body(request, CompletionRequest), request)

    @router.post("/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(ctx, body, request)

    return router


def _responses_router(
    ctx: ServingContext,
    store: ResponseStore,
    require_key: Callable[[Request], Awaitable[None]],
) -> APIRouter:
    router = APIRouter(prefix="/v1/responses", dependencies=[Depends(require_key)])

    @router.post("", response_model=None)
    async def create(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        return await create_response(ctx, store, body, request)

    @router.get("/{response_id}")
    async def get(response_id: str) -> dict[str, Any]:
        return get_response(store, response_id)

    @router.delete("/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        return delete_response(store, response_id)

    return router


def _model_card(ctx: ServingContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "sparsevllm",
        "root": ctx.engine.config.model or ctx.model_name,
        "max_model_len": ctx.max_model_len,
        "sparse_method": ctx.engine.config.sparse_method,
        # Every method a request may choose (`sparse_method` in a request body).
        "sparse_methods": list(ctx.engine.config.served_methods),
    }


def _add_ops_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return version()

    @app.get("/health", response_model=None)
    async def health() -> Response:
        if ctx.engine.accepting:
            return JSONResponse({"status": "ok"})
        return APIError(503, "the engine is not running", type="service_unavailable").response()

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        text = ctx.engine.metrics.render(ctx.engine.stats(), ctx.model_name)
        return Response(text, media_type=CONTENT_TYPE)


def _add_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if exc.status >= 500:
            logger.error("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
        response = error.response()
        response.headers.update(exc.headers or {})
        return response

    async def validation_error(request: Request, exc: Exception) -> Response:
        # Only FastAPI-parsed parameters reach this (bodies are parsed by parse_body).
        return bad_request(f"invalid request: {exc}").response()

    async def too_large(request: Request, exc: Exception) -> Response:
        return _too_large(max_body_bytes).response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises the exception after this response, so uvicorn logs it.
        return APIError(500, "internal server error", type="internal_server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(_BodyTooLarge, too_large)
    app.add_exception_handler(Exception, unexpected)
