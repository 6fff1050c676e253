"""One HTTP request through an ASGI app in this process, as a stream of parts: a
`ResponseHead`, then body chunks as the app sends them (an SSE stream chunk by chunk).

This is how a replica serves a request the ingress relays to it: the project's own
FastAPI app answers it, whole, with its validation, errors and streaming. Closing the
stream early (the ingress's client went away) tells the app the client disconnected,
so it aborts the engine requests, as a direct HTTP client's disconnect would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message

logger = logging.getLogger(__name__)

# Seconds the app may take to wind down once its client is gone.
_CLOSE_GRACE_S = 10.0


@dataclass(frozen=True)
class RelayedRequest:
    """An HTTP request as the ingress received it (header names lower-case)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class ResponseHead:
    """The status and headers of a replica's response, and which replica sent it."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None


def _scope(request: RelayedRequest) -> dict[str, object]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query,
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }


_INTERNAL_ERROR = (
    b'{"error": {"message": "internal server error", "type": "internal_server_error", '
    b'"param": null, "code": null}}'
)


async def call_asgi(
    app: ASGIApp, request: RelayedRequest, replica: str
) -> AsyncIterator[ResponseHead | bytes]:
    """The parts of `app`'s response to `request`: its head, then non-empty chunks."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_scope(request), receive, sent.put)
        except Exception:  # the app has sent its 500 (Starlette re-raises after it)
            logger.exception("%s %s failed", request.method, request.path)
            await sent.put({"type": "http.response.start", "status": 500, "headers": []})
            await sent.put({"type": "http.response.body", "body": _INTERNAL_ERROR})
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        async for part in _parts(sent, replica):
            yield part
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, _CLOSE_GRACE_S)


async def _parts(
    sent: asyncio.Queue[Message | None], replica: str
) -> AsyncIterator[ResponseHead | bytes]:
    started = False
    while True:
        message = await sent.get()
        if message is None:
            return
        if message["type"] == "http.response.start":
            if started:
                continue  # a late 500 after the response began: the stream just ends
            started = True
            yield ResponseHead(message["status"], list(message.get("headers", [])), replica)
        elif message["type"] == "http.response.body" and started:
            body = message.get("body", b"")
            if body:
                yield bytes(body)
            if not message.get("more_body", False):
                return
