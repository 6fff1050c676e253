"""Running the server: engine, worker thread and app under uvicorn, with graceful shutdown.

Shutdown on SIGINT/SIGTERM: uvicorn stops accepting connections and waits for the open
ones; at the same moment the engine stops accepting requests and lets the running ones
finish for up to `shutdown_grace_s`, then aborts them (streams end with finish_reason
"abort"). Once the connections are closed the app's lifespan stops the worker thread,
and the process exits with status 0. A second SIGINT forces the exit at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from sparsevllm.config import EngineConfig
from sparsevllm.server.app import build_app
from sparsevllm.server.async_engine import AsyncEngine
from sparsevllm.server.defaults import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_GRACE_S,
)

logger = logging.getLogger("sparsevllm.server")

# Extra time uvicorn gives connections after the engine's grace period has aborted
# everything (the aborted streams still have to send their last chunk).
_CONNECTION_GRACE_S = 5.0


class SparseServer(uvicorn.Server):
    """A uvicorn server whose exit signals also drain the engine, and that exits 0."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info(
                "%s: shutting down; running requests get %.1f s to finish",
                signal.Signals(sig).name,
                self.grace_s,
            )
        self.async_engine.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the captured signal after a graceful shutdown,
        # which would end the process with SIGTERM's status; a clean shutdown exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled in the main thread (e.g. in tests)
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def default_served_model_name(config: EngineConfig) -> str:
    """The model path as given, or the bundled default model's name."""
    if config.model is None:
        from sparsevllm.models.default_model import DEFAULT_MODEL_FILE

        return Path(DEFAULT_MODEL_FILE).name.split(".")[0]
    return config.model.rstrip("/")


def _model_path(config: EngineConfig) -> str:
    """What the engine loads: the --model path, or the bundled default model's file."""
    if config.model is not None:
        return config.model
    from sparsevllm.models.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:  # the engine reports it, with how to install it
        return "the bundled default model"


def make_server(
    async_engine: AsyncEngine,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    log_level: str = "info",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> SparseServer:
    """A server ready to `run()` (or to run in a thread: then no signal handling)."""
    name = served_model_name or default_served_model_name(async_engine.config)
    app = build_app(
        async_engine,
        name,
        api_key=api_key,
        max_queue_len=max_queue_len,
        max_body_bytes=max_body_bytes,
        max_stored_responses=max_stored_responses,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(shutdown_grace_s + _CONNECTION_GRACE_S),
        lifespan="on",
    )
    return SparseServer(config, async_engine, shutdown_grace_s)


def run_server(
    config: EngineConfig,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    log_level: str = "info",
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut down gracefully; returns 0."""
    from sparsevllm.engine.engine import LLMEngine

    if max_queue_len < 1:
        raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
    if shutdown_grace_s < 0:
        raise ValueError(f"shutdown_grace_s must be >= 0, got {shutdown_grace_s}")
    if log_level != "trace":  # uvicorn's extra level; logging has no TRACE
        logging.getLogger("sparsevllm.server").setLevel(log_level.upper())
    logger.info(
        "loading the engine (%s, sparse method %s)", _model_path(config), config.sparse_method
    )
    async_engine = AsyncEngine(LLMEngine(config))
    server = make_server(
        async_engine,
        host,
        port,
        api_key,
        served_model_name,
        max_queue_len,
        shutdown_grace_s,
        log_level,
        max_stored_responses=max_stored_responses,
        reasoning_parser=reasoning_parser,
        tool_call_parser=tool_call_parser,
    )
    server.run()
    logger.info("server stopped")
    return 0
