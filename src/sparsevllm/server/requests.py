"""What the server and its engine worker exchange: rejections, requests, commands."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams

if TYPE_CHECKING:
    from sparsevllm.server.async_engine import AsyncEngine


class RequestRejected(Exception):
    """The engine refused a submission; nothing of it is queued."""


class InvalidRequest(RequestRejected):
    """The engine's validation failed (a client error, HTTP 400); `param` is the field
    the engine's error named (e.g. structured_outputs), if any."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChainBusy(InvalidRequest):
    """The named chain is being extended by another running request (HTTP 409)."""


class QueueFull(RequestRejected):
    """More requests would wait than allowed (HTTP 429)."""


class EngineClosed(RequestRejected):
    """The engine is shutting down or its worker is gone (HTTP 503)."""


class EngineFailure(RequestRejected):
    """The engine raised something other than a ValueError (HTTP 500)."""


@dataclass(frozen=True)
class EngineRequest:
    """One engine request: a tokenized prompt and its sampling parameters (n == 1)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    chain_id: str | None = None  # chain cache: the conversation to continue


@dataclass(frozen=True)
class ChainInfo:
    """The chain the engine assigned a request at submission (None, None: no chain cache)."""

    chain_id: str | None = None
    status: str | None = None  # continued | new | not_found | diverged: ...


@dataclass
class Submission:
    requests: list[EngineRequest]
    queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    arrival: float


@dataclass
class SubmitAck:
    error: RequestRejected | None = None
    chains: dict[str, ChainInfo] = field(default_factory=dict)


@dataclass
class EngineCall:
    fn: Callable[[Any], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclass
class LiveRequest:
    """Worker-side bookkeeping of one engine request."""

    queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    arrival: float
    first_token: float | None = None


@dataclass
class RequestStream:
    """The outputs of one submission, in the order the worker produced them."""

    engine: AsyncEngine
    request_ids: list[str]
    queue: asyncio.Queue[Any]
    unfinished: set[str] = field(default_factory=set)
    chains: dict[str, ChainInfo] = field(default_factory=dict)  # by request id

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def next(self) -> RequestOutput:
        out: RequestOutput = await self.queue.get()
        if out.finished:
            self.unfinished.discard(out.request_id)
        return out

    def abort(self) -> None:
        """Abort whatever has not finished (safe to call any number of times)."""
        if self.unfinished:
            self.engine.abort(sorted(self.unfinished))
            self.unfinished.clear()


def settle_call(call: EngineCall, result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a call's future on its own loop (unless its caller has gone)."""

    def resolve() -> None:
        if call.future.done():  # cancelled: the caller went away
            return
        if error is not None:
            call.future.set_exception(error)
        else:
            call.future.set_result(result)

    try:
        call.loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the event loop is closed
        pass
