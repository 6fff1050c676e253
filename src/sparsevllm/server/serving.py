"""What the endpoints share: tokenization, submission, collection, SSE streaming."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from sparsevllm.outputs import RequestOutput
from sparsevllm.sampling import SamplingParams
from sparsevllm.server.async_engine import (
    AsyncEngine,
    ChainBusy,
    ChainInfo,
    EngineClosed,
    EngineFailure,
    EngineRequest,
    InvalidRequest,
    QueueFull,
    RequestStream,
)
from sparsevllm.server.errors import APIError, bad_request
from sparsevllm.server.formatting import SSE_DONE, Choice, PromptInput, TokenStrings, sse
from sparsevllm.server.protocol import CHAIN_ID_HEADER, check_chain_id
from sparsevllm.server.reasoning import ReasoningParser
from sparsevllm.server.tool_parsers import ToolParser

logger = logging.getLogger(__name__)

ChunkMaker = Callable[[Choice, RequestOutput], list[dict[str, Any]]]


class ServingContext:
    """Per-app state of the endpoints: the engine, the model name and the limits.

    Tokenization (and chat templating) runs on one dedicated thread: it can take a while
    for a long prompt and must not stall the event loop, and one thread means the
    tokenizer is never entered by two encodes at once.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        max_queue_len: int,
        reasoning: ReasoningParser | None = None,
        tool_parser: ToolParser | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_queue_len = max_queue_len
        self.reasoning = reasoning  # splits replies' <think> text from their content
        self.tool_parser = tool_parser  # finds the tool calls of `tool_choice: auto` replies
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.token_strings = TokenStrings(engine.tokenizer)
        self.created = int(time.time())
        self.response_id_prefix = ""  # after `resp_` in response ids (build_app's)
        self._admitting = 0  # sequences between their body's parse and their submission
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparsevllm-tok")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_fan_out(self, num_sequences: int, param: str = "n") -> None:
        if num_sequences > self.max_queue_len:
            raise bad_request(
                f"the request asks for {num_sequences} sequences (prompts x n), but at most "
                f"{self.max_queue_len} may wait at once on this server",
                param=param,
            )

    @contextlib.contextmanager
    def admitting(self, num_sequences: int) -> Iterator[Admission]:
        """Hold `num_sequences` places in the waiting queue while a request is tokenized,
        until `submit` hands them to the engine's own count. Beyond the queue limit a
        request is refused (429) before its prompts are tokenized: a client sending
        faster than the engine serves holds at most `max_queue_len` requests' prompts in
        the server, never an unbounded pile."""
        waiting = self.engine.num_waiting() + self._admitting
        if waiting + num_sequences > self.max_queue_len:
            raise _queue_full(waiting, self.max_queue_len)
        admission = Admission(self, num_sequences)
        self._admitting += num_sequences  # the event loop's thread only: no lock
        try:
            yield admission
        finally:
            admission.release()

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def tokenize(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids", param)
        return list(await self.run_in_tokenizer_thread(self.tokenizer.encode, text))

    async def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return await self.run_in_tokenizer_thread(self.tokenizer.decode, token_ids)

    async def submit(
        self,
        requests: list[EngineRequest],
        prompt_param: str,
        admission: Admission,
        structured_param: str | None = None,
    ) -> RequestStream:
        """Submit to the engine (its count of waiting requests takes over from
        `admission`); its refusals become API errors (one about the output constraint
        names `structured_param`, the request field that gave it)."""
        admission.release()
        try:
            return await self.engine.submit(requests, max_waiting=self.max_queue_len)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_exceeded", code="queue_full") from None
        except ChainBusy as e:
            raise APIError(
                409, str(e), type="conflict", param="chain_id", code="chain_busy"
            ) from None
        except InvalidRequest as e:
            message = str(e)
            param = "max_tokens" if "KV slots" in message else prompt_param
            if e.param == "structured_outputs":  # the constraint did not compile
                param = structured_param or e.param
                message = f"{param}: {message}"
            elif e.param is not None:  # e.g. the request's sparse_method or kv_budget
                param = e.param
            raise bad_request(message, param=param) from None
        except EngineClosed as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        except EngineFailure as e:
            raise APIError(500, str(e), type="internal_server_error") from None

    async def collect(
        self, stream: RequestStream, request: Request
    ) -> dict[str, RequestOutput] | None:
        """Final outputs by request id; None (requests aborted) if the client went away."""
        consumer = asyncio.ensure_future(_final_outputs(stream))
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            consumer.cancel()
            watcher.cancel()
            if not stream.done:
                logger.info(
                    "client disconnected: aborting %s", ", ".join(sorted(stream.unfinished))
                )
            stream.abort()
        if consumer.cancelled():
            return None
        return consumer.result()


@dataclasses.dataclass
class Admission:
    """Places a request holds in the waiting queue before the engine counts it."""

    ctx: ServingContext
    num_sequences: int

    def release(self) -> None:
        self.ctx._admitting -= self.num_sequences
        self.num_sequences = 0


def _queue_full(waiting: int, limit: int) -> APIError:
    message = f"{waiting} requests are waiting (limit {limit}); retry later"
    return APIError(429, message, type="rate_limit_exceeded", code="queue_full")


def resolve_chain_id(body_value: str | None, request: Request, num_sequences: int) -> str | None:
    """The request's chain id: the `chain_id` field or the X-SparseVLLM-Chain-ID header.

    Both may be given only with the same value. A chain has one writer, so a chain id
    with several sequences (n > 1 or several prompts) is refused.
    """
    headers = request.headers.getlist(CHAIN_ID_HEADER)
    header_value = None
    if headers:
        values = {h.strip() for h in headers}
        if len(values) > 1:
            raise bad_request(
                f"the {CHAIN_ID_HEADER} header is given {len(headers)} times with different "
                f"values; send it once",
                param="chain_id",
            )
        header_value = values.pop()
        try:
            check_chain_id(header_value, f"the {CHAIN_ID_HEADER} header")
        except ValueError as e:
            raise bad_request(str(e), param="chain_id") from None
    if body_value is not None and header_value is not None and body_value != header_value:
        raise bad_request(
            f"the chain_id field ({body_value!r}) and the {CHAIN_ID_HEADER} header "
            f"({header_value!r}) differ; send one of them, or the same id in both",
            param="chain_id",
            code="chain_id_conflict",
        )
    chain_id = body_value if body_value is not None else header_value
    if chain_id is not None and num_sequences > 1:
        raise bad_request(
            f"chain_id names one conversation, but this request asks for {num_sequences} "
            f"sequences (n > 1 or several prompts); send one prompt with n = 1",
            param="chain_id",
        )
    return chain_id


def chain_of(stream: RequestStream) -> ChainInfo:
    """The response's chain: that of its only sequence (none when it has several)."""
    if len(stream.request_ids) != 1:
        return ChainInfo()
    return stream.chains.get(stream.request_ids[0], ChainInfo())


@dataclasses.dataclass
class ChainFields:
    """`chain_id` and `chain_status` of a response: top-level for every body and chunk;
    with several choices the top-level ones are null and each choice carries its own."""

    top: dict[str, Any]
    per_choice: dict[str, dict[str, Any]]  # by request id; empty for a single choice

    @classmethod
    def of(cls, stream: RequestStream) -> ChainFields:
        info = chain_of(stream)
        per_choice: dict[str, dict[str, Any]] = {}
        if len(stream.request_ids) > 1 and any(c.chain_id for c in stream.chains.values()):
            for request_id in stream.request_ids:
                each = stream.chains.get(request_id, ChainInfo())
                per_choice[request_id] = {"chain_id": each.chain_id, "chain_status": each.status}
        return cls({"chain_id": info.chain_id, "chain_status": info.status}, per_choice)

    def choice(self, request_id: str) -> dict[str, Any]:
        return self.per_choice.get(request_id, {})


def chain_headers(stream: RequestStream) -> dict[str, str]:
    chain_id = chain_of(stream).chain_id
    return {CHAIN_ID_HEADER: chain_id} if chain_id is not None else {}


async def _final_outputs(stream: RequestStream) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    while not stream.done:
        out = await stream.next()
        if out.finished:
            finals[out.request_id] = out
    return finals


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect (the same signal
    # Starlette's StreamingResponse listens for).
    while (await request.receive())["type"] != "http.disconnect":
        pass


def fan_out(
    base_id: str,
    prompts: list[PromptInput],
    params: SamplingParams,
    n: int,
    chain_id: str | None = None,
) -> tuple[list[Choice], list[EngineRequest]]:
    """One engine request per (prompt, sample); sample i of a seeded request uses seed + i."""
    choices: list[Choice] = []
    requests: list[EngineRequest] = []
    for p_index, prompt in enumerate(prompts):
        for i in range(n):
            seed = None if params.seed is None else params.seed + i
            sample_params = dataclasses.replace(params, seed=seed)
            request_id = f"{base_id}-{p_index}-{i}"
            choices.append(Choice(p_index * n + i, p_index, request_id, list(params.stop)))
            requests.append(EngineRequest(request_id, prompt.token_ids, sample_params, chain_id))
    return choices, requests


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def raise_for_errors(finals: dict[str, RequestOutput]) -> None:
    """A request the engine failed (not a client error: the input was validated) is a 500."""
    for out in finals.values():
        if out.finish_reason == "error":
            raise APIError(500, out.error or "the engine failed", type="internal_server_error")


class EventStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends.

    When the client disconnects, Starlette cancels the sending task. If the generator
    was suspended at a `yield`, nothing would close it until garbage collection, and if
    it never started (the client left before the first byte), its `finally` never runs;
    so the response closes the generator and aborts the stream itself.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **chain_headers(stream)}
        super().__init__(content, headers=headers)
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self.stream.abort()  # no-op when every request finished


async def event_stream(
    stream: RequestStream,
    choices: list[Choice],
    head: list[dict[str, Any]],
    make_chunks: ChunkMaker,
    tail: Callable[[], list[dict[str, Any]]],
) -> AsyncIterator[str]:
    """SSE events of a response: `head`, chunks per output, `tail`, then [DONE].

    The `finally` runs on normal completion, on an engine error, and when the client
    disconnects (CancelledError at an await, GeneratorExit at a yield): it aborts the
    requests that have not finished, which frees their KV slots.
    """
    by_id = {c.request_id: c for c in choices}
    try:
        for chunk in head:
            yield sse(chunk)
        while not stream.done:
            out = await stream.next()
            choice = by_id.get(out.request_id)
            if choice is None:
                continue
            if out.finish_reason == "error":
                error = APIError(
                    500, out.error or "the engine failed", type="internal_server_error"
                )
                yield sse(error.body())
                return
            if out.finished:
                choice.final = out
            for chunk in make_chunks(choice, out):
                yield sse(chunk)
        for chunk in tail():
            yield sse(chunk)
        yield SSE_DONE
    finally:
        if not stream.done:
            logger.info("stream ended early: aborting %s", ", ".join(sorted(stream.unfinished)))
        stream.abort()


async def respond(
    ctx: ServingContext,
    raw: Request,
    stream: RequestStream,
    choices: list[Any],
    fmt: Any,
    head: list[Any],
    streaming: bool,
) -> Response:
    """The response of a submitted request: an SSE stream, or one JSON body once every
    choice finished (`fmt` formats chunks, the tail and the body of its endpoint)."""
    if streaming:
        events = event_stream(stream, choices, head, fmt.chunks, fmt.tail(choices))
        return EventStreamResponse(events, stream)
    finals = await ctx.collect(stream, raw)
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    raise_for_errors(finals)
    for c in choices:
        c.final = finals[c.request_id]
    return JSONResponse(fmt.body(choices), headers=chain_headers(stream))
