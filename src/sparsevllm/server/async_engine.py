"""AsyncEngine: a worker thread owns the (not thread-safe) LLMEngine; asyncio talks to it.

Threading model. Exactly one thread, the worker, ever calls the engine after start().
HTTP handlers (on the event loop) put commands on a thread-safe queue: *submit* (one or
more engine requests answered together) and *abort*. The worker drains that queue
between engine steps, so a request that arrives while others run joins the running
batch at the next step (continuous batching). Each submission brings its own
asyncio.Queue; the worker hands it an acknowledgement (or the rejection) and then every
RequestOutput of its requests via `loop.call_soon_threadsafe`, so handlers never block.
A third command, *call*, runs a function on the engine in the worker between steps and
answers through an asyncio future: how the event loop reads engine state (such as the
cache listing) without racing the worker that mutates it.

Fault isolation. A bad request fails in `add_request` (validation) and only its
submission is rejected. An exception inside `engine.step()` cannot be pinned to one
request, so the requests in flight are failed with an error output, their KV slots
released, and the worker goes on serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sparsevllm.engine.cache.store import ChainBusyError
from sparsevllm.outputs import RequestOutput
from sparsevllm.server.cache import persist_chains
from sparsevllm.server.metrics import ServerMetrics
from sparsevllm.server.requests import (  # noqa: F401 (re-exported)
    ChainBusy,
    ChainInfo,
    EngineCall,
    EngineClosed,
    EngineFailure,
    EngineRequest,
    InvalidRequest,
    LiveRequest,
    QueueFull,
    RequestRejected,
    RequestStream,
    Submission,
    SubmitAck,
    settle_call,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long an idle worker sleeps on the command queue before re-checking its deadlines.
_IDLE_WAIT_S = 0.1


class AsyncEngine:
    """Runs an LLMEngine's step loop in a background thread and serves asyncio callers.

    Construct it with a ready engine; after `start()` only the worker touches it. The
    facts handlers need (tokenizer, max_model_len, config) are read here, up front.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.config = engine.config
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._live: dict[str, LiveRequest] = {}  # worker thread only
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet added (or rejected) by the worker
        self._stats: dict[str, Any] = {}
        self._stats = self._safe_stats()
        self._closing = False
        self._deadline: float | None = None  # abort everything in flight after this
        self._stop_requested = False
        self._flush_needed = False  # aborted requests to be reported by a step
        self._exited = False  # the worker has left its loop; nothing more is enqueued
        self._thread: threading.Thread | None = None

    # -- lifecycle (any thread) -----------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparsevllm-engine", daemon=True)
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self.is_alive and not self._closing

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop accepting; requests in flight may finish within `grace_s`, then are aborted.

        Safe to call from a signal handler: it sets fields and puts on a SimpleQueue.
        """
        if not self._closing:
            self._closing = True
            self._deadline = time.monotonic() + max(grace_s, 0.0)
            self._commands.put(("wake", None))

    def stop(self, grace_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Shut down (see begin_shutdown) and wait for the worker thread to exit."""
        self.begin_shutdown(grace_s)
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(join_timeout_s)
            if self._thread.is_alive():
                logger.warning("engine worker did not stop within %.0f s", join_timeout_s)

    # -- handler side (event loop thread) -------------------------------------------------
    def num_waiting(self) -> int:
        """Requests not yet running: queued here plus waiting inside the engine."""
        with self._lock:
            return self._pending + int(self._stats.get("num_waiting", 0))

    def stats(self) -> dict[str, Any]:
        """The engine's stats() as of the end of the worker's last step."""
        return self._stats

    async def submit(
        self, requests: list[EngineRequest], max_waiting: int | None = None
    ) -> RequestStream:
        """Queue requests atomically (all or none) and return their output stream.

        Raises QueueFull when more than `max_waiting` requests would be waiting,
        EngineClosed while shutting down, InvalidRequest when the engine's validation
        fails (the message says why) and EngineFailure on any other engine error.
        """
        if not self.accepting:
            raise EngineClosed("the server is shutting down")
        waiting = self.num_waiting()
        if max_waiting is not None and waiting + len(requests) > max_waiting:
            raise QueueFull(f"{waiting} requests are waiting (limit {max_waiting}); retry later")
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            self._pending += len(requests)
        sub = Submission(requests, out_queue, loop, time.perf_counter())
        if not self._enqueue("submit", sub):
            with self._lock:
                self._pending -= len(requests)
            raise EngineClosed("the server is shutting down")
        stream = RequestStream(self, [r.request_id for r in requests], out_queue)
        try:
            ack: SubmitAck = await out_queue.get()
        except asyncio.CancelledError:
            stream.abort()  # the abort command follows the submit: it always finds them
            raise
        if ack.error is not None:
            stream.unfinished.clear()
            raise ack.error
        stream.chains = ack.chains
        return stream

    async def call(self, fn: Callable[[Any], _T]) -> _T:
        """Run `fn(engine)` on the worker thread between steps and return its result.

        The only safe way to read engine state from the event loop. Raises EngineClosed
        when the worker is not running; `fn`'s own exception is re-raised here.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        if not self.is_alive or not self._enqueue("call", EngineCall(fn, future, loop)):
            raise EngineClosed("the engine worker is not running")
        return await future

    def _enqueue(self, kind: str, payload: Any) -> bool:
        """Queue a command for the worker; False once the worker has exited (an answer
        would never come). Under the lock, so the worker's final drain sees every one."""
        with self._lock:
            if self._exited:
                return False
            self._commands.put((kind, payload))
            return True

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; thread-safe, returns at once (the worker frees their slots)."""
        self._commands.put(("abort", list(request_ids)))

    # -- worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine worker started")
        while True:
            try:
                if self._iterate():
                    break
            except Exception:  # a bug here must not kill the only thread serving requests
                logger.exception("engine worker error; failing the requests in flight")
                self._fail_all("internal engine error")
                time.sleep(_IDLE_WAIT_S)
        self._refuse_leftovers()
        persist_chains(self._engine)  # cached state goes to the disk tier, for the next server
        close = getattr(self._engine, "close", None)  # stops tensor-parallel ranks (fakes lack it)
        if close is not None:
            close()
        logger.info("engine worker stopped")

    def _refuse_leftovers(self) -> None:
        """Answer the commands that raced the worker's exit, so no caller waits forever."""
        with self._lock:
            self._exited = True
        closed = EngineClosed("the server is shutting down")
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                with self._lock:
                    self._pending -= len(payload.requests)
                self._post(payload.loop, payload.queue, SubmitAck(closed))
            elif kind == "call":
                settle_call(payload, error=closed)

    def _iterate(self) -> bool:
        """One round: commands, deadline, one step. Returns True when the worker should exit."""
        busy = self._engine.has_unfinished_requests() or self._flush_needed
        self._drain_commands(block=not busy)
        if self._deadline is not None and time.monotonic() >= self._deadline and self._live:
            logger.info("shutdown grace period over: aborting %d request(s)", len(self._live))
            for request_id in list(self._live):
                self._flush_needed |= self._engine.abort_request(request_id)
        if self._engine.has_unfinished_requests() or self._flush_needed:
            self._step()
        return self._stop_requested and not self._live and not self._flush_needed

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else None
            while True:
                if command is not None:
                    self._handle(*command)
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "submit":
            self._add(payload)
        elif kind == "abort":
            for request_id in payload:
                self._flush_needed |= self._engine.abort_request(request_id)
        elif kind == "call":
            try:
                result = payload.fn(self._engine)
            except Exception as e:
                settle_call(payload, error=e)
            else:
                settle_call(payload, result=result)
        elif kind == "stop":
            self._stop_requested = True

    def _add(self, sub: Submission) -> None:
        added: list[str] = []
        chains: dict[str, ChainInfo] = {}
        error: RequestRejected | None = None
        try:
            if self._closing and self._deadline is not None and time.monotonic() >= self._deadline:
                raise EngineClosed("the server is shutting down")
            validate = getattr(self._engine, "validate", None)
            if len(sub.requests) > 1 and validate is not None:
                # Validate all first: rolling back an added request that continued a
                # chain would lose the chain (its state is consumed when it starts).
                for r in sub.requests:
                    validate(r.prompt_token_ids, r.params)
            for r in sub.requests:
                # chain_id only when given: engines without a chain cache need not take it.
                extra = {} if r.chain_id is None else {"chain_id": r.chain_id}
                self._engine.add_request(r.prompt_token_ids, r.params, r.request_id, **extra)
                added.append(r.request_id)
                chains[r.request_id] = self._chain_of(r.request_id)
        except Exception as e:
            for request_id in added:  # all or nothing
                self._flush_needed |= self._engine.abort_request(request_id)
            chains = {}
            if isinstance(e, RequestRejected):
                error = e
            elif isinstance(e, ChainBusyError):
                error = ChainBusy(str(e))
            elif isinstance(e, ValueError):
                error = InvalidRequest(str(e), getattr(e, "param", None))
            else:
                logger.exception("add_request failed")
                error = EngineFailure(f"the engine failed to add the request: {e}")
        else:
            for r in sub.requests:
                self._live[r.request_id] = LiveRequest(sub.queue, sub.loop, sub.arrival)
            self.metrics.add_prompt_tokens(sum(len(r.prompt_token_ids) for r in sub.requests))
        finally:
            # The new waiting count and the lower `pending` are published together, so
            # the queue-limit check in submit() counts each request exactly once.
            stats = self._safe_stats()
            with self._lock:
                self._stats = stats
                self._pending -= len(sub.requests)
        self._post(sub.loop, sub.queue, SubmitAck(error, chains))

    def _chain_of(self, request_id: str) -> ChainInfo:
        """The chain id and status the engine just gave a request (known from add_request
        on, so streams can name it in their headers before the first token)."""
        chain_of = getattr(self._engine, "chain_of", None)  # test fakes may lack it
        return ChainInfo(*chain_of(request_id)) if chain_of else ChainInfo(None, None)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as e:
            logger.exception(
                "engine step failed; failing the %d request(s) in flight", len(self._live)
            )
            self._fail_all(f"the engine failed while running this request: {e}")
            return
        self._flush_needed = False
        # Stats first: a client that sees its request finish then sees it in /metrics.
        self._refresh_stats()
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return  # its submission was rolled back, or it was failed already
        now = time.perf_counter()
        if live.first_token is None and out.token_ids:
            live.first_token = now
            self.metrics.observe_first_token(now - live.arrival)
        if out.finished:
            del self._live[out.request_id]
            n = len(out.token_ids)
            per_token = None
            if live.first_token is not None and n > 1:
                per_token = (now - live.first_token) / (n - 1)
            self.metrics.observe_finished(
                out.finish_reason or "abort", now - live.arrival, per_token
            )
        if not self._post(live.loop, live.queue, out) and not out.finished:
            self._flush_needed |= self._engine.abort_request(out.request_id)  # loop is gone

    def _fail_all(self, message: str) -> None:
        """Fail every request in flight with an error output and release its KV slots."""
        for request_id, live in list(self._live.items()):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
            error = RequestOutput.single(
                request_id, None, [], "", [], finished=True, finish_reason="error", error=message
            )
            self.metrics.observe_finished("error", time.perf_counter() - live.arrival, None)
            self._post(live.loop, live.queue, error)
        self._live.clear()
        try:
            self._engine.step()  # reports (and forgets) the aborted requests
        except Exception:
            logger.exception("engine step after failure also failed")
        self._flush_needed = False
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self._safe_stats()
        with self._lock:
            self._stats = stats

    def _safe_stats(self) -> dict[str, Any]:
        try:
            stats = self._engine.stats()
            if "num_idle_chains" in stats:  # chains no running request extends
                stats["idle_chains"] = stats["num_idle_chains"]
            return stats
        except Exception:
            logger.exception("engine.stats() failed")
            return self._stats

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[Any], item: Any) -> bool:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
            return True
        except RuntimeError:  # the event loop is closed: nobody will read this
            return False
