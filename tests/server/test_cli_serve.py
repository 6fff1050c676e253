"""`sparsevllm serve` as a user runs it: --help, and a graceful exit on SIGTERM/SIGINT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sparsevllm import EngineConfig

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC}


def test_serve_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--api-key", "--host", "--port", "--served-model-name", "--max-queue-len"):
        assert flag in out.stdout
    assert "--shutdown-grace-s" in out.stdout and "429" in out.stdout
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in out.stdout


class ServeProcess:
    """`python -m sparsevllm.cli serve` on a free port, its log collected by a thread."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "sparsevllm.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_for_url()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(r"Uvicorn running on (http://\S+)", line)
                if match:
                    return match.group(1)
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError("the server did not start:\n" + "".join(self.lines))

    def log(self) -> str:
        self._reader.join(10)
        return "".join(self.lines)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_aborts_running_requests_and_exits_0(tiny_path, sig):
    server = ServeProcess(
        "--model", tiny_path, "--max-model-len", "512", "--served-model-name", "tiny",
        "--shutdown-grace-s", "0",
    )  # fmt: skip
    body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 500, "stream": True}
    body["ignore_eos"] = True
    events: list[dict] = []
    with httpx.Client(timeout=60) as client:
        assert client.get(server.url + "/health").status_code == 200
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    break
            server.proc.send_signal(sig)
            rest = [line for line in lines if line.startswith("data: ")]
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    assert last["choices"][0]["finish_reason"] == "abort"  # grace 0: aborted at once
    log = server.log()
    assert "shutting down" in log and "engine worker stopped" in log
    assert "Traceback" not in log


def test_serve_takes_the_model_as_a_positional_argument(tiny_path):
    """`sparsevllm serve MODEL`, as vLLM takes it (--model still works: the tests above)."""
    server = ServeProcess(tiny_path, "--max-model-len", "512", "--served-model-name", "tiny")
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["root"] == tiny_path
    finally:
        server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()


def test_serve_model_given_twice_is_a_usage_error(tiny_path):
    out = subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", "serve", tiny_path, "--model", "/other"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 2 and "given twice" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_default_model_is_named_in_the_loading_log():
    """Problem 10: the log said `loading the engine (None, ...)` for the default model."""
    try:
        from sparsevllm.models.default_model import default_model_path

        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server = ServeProcess("--max-model-len", "512")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()
    loading = next(line for line in server.log().splitlines() if "loading the engine" in line)
    assert path in loading and "None" not in loading
