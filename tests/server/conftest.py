"""Server fixtures: real uvicorn servers on 127.0.0.1, each in a background thread."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from sparsevllm.config import EngineConfig
from sparsevllm.engine.engine import LLMEngine
from sparsevllm.server.async_engine import AsyncEngine
from sparsevllm.server.launcher import SparseServer, default_served_model_name, make_server
from sparsevllm.server.metrics import parse_metrics

TINY_NAME = "tiny"


@dataclass
class RunningServer:
    """A started server and handy clients for it."""

    url: str
    model: str
    server: SparseServer
    engine: AsyncEngine
    thread: threading.Thread
    api_key: str | None = None

    def client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kwargs)

    def metrics(self) -> dict[str, float]:
        response = httpx.get(self.url + "/metrics", timeout=30)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        return parse_metrics(response.text)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and no KV slot is held outside the cache."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            held = m["sparsevllm:kv_slots_used"] - m.get("sparsevllm:kv_slots_cached", 0)
            running = m["sparsevllm:num_requests_running"] + m["sparsevllm:num_requests_waiting"]
            if (held == 0 and running == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not shut down"
        assert not self.engine.is_alive, "the engine worker did not stop"


def hang_up_mid_stream(server: RunningServer, body: dict[str, Any], events: int) -> None:
    """POST a streaming completion and close the connection after `events` data events
    (all of them unfinished)."""
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    seen += 1
                    if seen == events:
                        return


def python_example(doc: str, heading: str) -> str:
    """The first ```python block after `heading` in a Markdown file."""
    section = doc[doc.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def start_server(config: EngineConfig, **kwargs: Any) -> RunningServer:
    """Load the engine, bind a free port and serve in a thread (no signal handlers there).
    `engine_setup(llm_engine)`, if given, runs before the worker starts."""
    setup = kwargs.pop("engine_setup", None)
    llm_engine = LLMEngine(config)
    if setup is not None:
        setup(llm_engine)
    engine = AsyncEngine(llm_engine)
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("shutdown_grace_s", 1.0)
    # Port 0: the OS picks a free port when uvicorn binds, so there is no race for it.
    # (Passing a pre-bound socket instead costs ~40 ms per request: no TCP_NODELAY.)
    server = make_server(engine, port=0, **kwargs)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    name = kwargs.get("served_model_name") or default_served_model_name(config)
    return RunningServer(
        f"http://127.0.0.1:{port}", name, server, engine, thread, kwargs.get("api_key")
    )


def tiny_config(path: str, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {"model": path, "max_model_len": 512, "num_kv_slots": 16384}
    # Without a prefix cache, KV slots used drop to 0 once nothing runs (the engine
    # may gain or lose this field while it is being developed).
    if "enable_prefix_caching" in EngineConfig.field_names():
        values["enable_prefix_caching"] = False
    return EngineConfig.from_dict({**values, **overrides})


def snapkv_chain_config(path: str, budget: int = 16, **overrides: Any) -> EngineConfig:
    """SnapKV with a small budget over the tiny model (every prompt of the tests evicts)
    and, with prefix caching, its cross-request mode: the chain cache."""
    values: dict[str, Any] = {
        "sparse_method": "snapkv",
        "decode_keep_tokens": budget,
        "sink_keep_tokens": 2,
        "recent_keep_tokens": 4,
        "snapkv_window_size": 4,
        "chunk_prefill_size": 32,
    }
    return tiny_config(path, **{**values, **overrides})


@pytest.fixture(scope="session")
def tiny_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_server(tiny_path: str) -> Iterator[RunningServer]:
    running = start_server(tiny_config(tiny_path), served_model_name=TINY_NAME)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_server: RunningServer) -> Any:
    return tiny_server.engine.tokenizer
