"""The bundled default model (SmolLM2-135M-Instruct GGUF) served with `LLM()` defaults."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparsevllm.config import EngineConfig
from sparsevllm.models.default_model import default_model_path

from .conftest import RunningServer, python_example, start_server

NAME = "SmolLM2-135M-Instruct"
MAX_TOKENS = 5  # slow-ish on CPU: a few tokens prove the path


@pytest.fixture(scope="module")
def default_server() -> Iterator[RunningServer]:
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    running = start_server(EngineConfig())  # model=None: the bundled GGUF
    assert running.model == NAME
    yield running
    running.stop()


def test_default_model_chat(default_server: RunningServer):
    client = default_server.client()
    assert [m.id for m in client.models.list().data] == [NAME]
    kwargs = {
        "model": NAME,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    result = client.chat.completions.create(**kwargs)
    text = result.choices[0].message.content
    assert text and result.usage.completion_tokens <= MAX_TOKENS
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == result.usage.prompt_tokens


def test_default_model_completions(default_server: RunningServer):
    client = default_server.client()
    kwargs = {"model": NAME, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS}
    result = client.completions.create(temperature=0.0, **kwargs)
    assert result.choices[0].text.strip()
    stream = client.completions.create(temperature=0.0, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream) == result.choices[0].text


def test_server_doc_completions_example_runs(default_server: RunningServer):
    """Problem 2: docs/server.md's Python completions example got a 400."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    code = python_example(doc, "### `POST /v1/completions`")
    assert "client.completions.create" in code
    printed: list[tuple] = []
    scope = {"client": default_server.client(), "print": lambda *a, **k: printed.append(a)}
    exec(compile(code, "docs/server.md", "exec"), scope)
    assert printed and all(len(args) == 3 for args in printed)
