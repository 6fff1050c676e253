"""End-to-end CLI tests (subprocess, as a user would run it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sparsevllm import EngineConfig

SRC = str(Path(__file__).resolve().parents[2] / "src")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_help_documents_every_engine_flag():
    out = cli("generate", "--help")
    assert out.returncode == 0
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in out.stdout
    assert "--json" in out.stdout and "--max-tokens" in out.stdout


def test_generate_json(tiny_llama, tmp_path):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"max_num_seqs": 2, "chunk_prefill_size": 8}))
    out = cli(
        "generate",
        "--model",
        tiny_llama,
        "--config",
        str(config),
        "--prompt",
        "w1 w2 w3",
        "--chat",
        "w4 w5",
        "--batch-size",
        "2",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert len(report["outputs"]) == 4
    assert all(len(o["token_ids"]) == 5 for o in report["outputs"])
    assert report["config"]["max_num_seqs"] == 2 and report["config"]["chunk_prefill_size"] == 8
    assert report["stats"]["max_concurrent_seqs"] == 2
    assert report["summary"]["output_tokens"] == 20


def test_bad_flag_value_is_a_clear_error(tiny_llama):
    out = cli("generate", "--model", tiny_llama, "--prompt", "w1", "--dtype", "float33")
    assert out.returncode == 2
    assert "dtype must be one of" in out.stderr and "Traceback" not in out.stderr
    out = cli("generate", "--model", "/nonexistent/model", "--prompt", "w1")
    assert out.returncode == 2 and "not found" in out.stderr


def test_methods_json():
    out = cli("methods", "--json")
    assert out.returncode == 0
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["snapkv"]["family"] == "physical_eviction"
    assert rows["pyramidkv"]["prefill_policy"] == "long_bs1full_short_batch"
    assert rows["streamingllm"]["aliases"] == ["attention-sink", "attention_sink", "streaming"]
    assert rows["snapkv"]["knobs"]["snapkv_window_size"] == 32
    assert rows["quest"]["decode_views"] == "graph" and rows["h2o"]["decode_views"] == "none"
    text = cli("methods")
    assert text.returncode == 0 and "quest" in text.stdout


# ---------------------------------------------------------------- issue 24: a new user's hour


def test_logprobs_flag_prints_logprobs(tiny_llama):
    """Problem 1: --logprobs N reports the chosen token's logprob and the top N."""
    base = ["generate", "--model", tiny_llama, "--prompt", "w1 w2", "--max-tokens", "3"]
    out = cli(*base, "--logprobs", "2", "--json", "--no-progress")
    assert out.returncode == 0, out.stderr
    (entry,) = json.loads(out.stdout)["outputs"]
    assert len(entry["logprobs"]) == 3
    for step, token_id in zip(entry["logprobs"], entry["token_ids"]):
        assert step["token_id"] == token_id and step["logprob"] <= 0
        assert len(step["top_logprobs"]) == 2 and isinstance(step["token"], str)
    assert entry["cumulative_logprob"] == sum(s["logprob"] for s in entry["logprobs"])
    text = cli(*base, "--logprobs", "2", "--no-progress")
    assert text.returncode == 0, text.stderr
    assert text.stdout.count("logprob ") == 3 and "top:" in text.stdout


def test_help_shows_percent_signs_not_argparse_internals():
    """Problem 3: an unescaped % in a help text printed argparse's parameter dict."""
    for command in (["generate"], ["serve"], ["bench", "throughput"]):
        out = cli(*command, "--help")
        assert out.returncode == 0, out.stderr
        assert "2% slower" in out.stdout and "'prog':" not in out.stdout, command


NO_MODEL = "/nonexistent/model"  # validation must not need (or reach) the model


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", ""], "--prompt is empty"),
        (["generate", "--prompt-file", "/nonexistent/prompts.txt"], "prompt file"),
        (["generate", "--prompt", "w1", "--batch-size", "0"], "--batch-size must be"),
        (["generate", "--random-prompt-tokens", "0"], "--random-prompt-tokens must be"),
        (["generate"], "give --prompt"),
        (["generate", "--prompt", "w1", "--max-tokens", "0"], "max_tokens must be"),
        (["generate", "--system", "Be brief", "--prompt", "w1"], "--system"),
        (["generate", "--prompt", "w1", "--dtype", "float33"], "dtype must be one of"),
        (["--log-level", "foo", "methods"], "--log-level"),
        (["generate", "--prompt", "w1", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_usage_errors_exit_2_with_one_line_before_loading(args, message):
    """Problem 5 and fail-fast: every input error exits 2 with one line on stderr, and
    errors that need no model come before the (missing) model is looked at."""
    model_args = ["--model", NO_MODEL] if args[0] == "generate" else []
    out = cli(*args, *model_args)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_device_cuda_without_cuda_fails_before_loading():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = cli("generate", "--prompt", "w1", "--device", "cuda", "--model", NO_MODEL)
    assert out.returncode == 2 and "CUDA is not available" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_missing_model_is_a_usage_error():
    out = cli("generate", "--prompt", "w1", "--model", NO_MODEL)
    assert out.returncode == 2 and "not found" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_closed_pipe_exits_quietly():
    """Problem 5: `sparsevllm methods --json | head -1` printed a BrokenPipeError."""
    env = {**os.environ, "PYTHONPATH": SRC}
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sparsevllm.cli", "methods", "--json"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == ""


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_quietly_with_130(tiny_llama):
    """Problem 5: Ctrl-C during generate printed a traceback."""
    env = {**os.environ, "PYTHONPATH": SRC}
    cmd = [sys.executable, "-m", "sparsevllm.cli", "generate", "--model", tiny_llama]
    cmd += ["--prompt", "w1", "--batch-size", "4", "--max-tokens", "2000", "--ignore-eos"]
    # A shell's background job starts with SIGINT ignored, and Python keeps an inherited
    # SIG_IGN, so the child restores the default a terminal's foreground job would have.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=_sigint_default,
    )
    err = b""
    try:
        assert proc.stderr is not None
        while b"Processed prompts" not in err:  # generating: the progress bar is up
            chunk = proc.stderr.read1(4096)
            assert chunk, err.decode()
            err += chunk
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err += proc.stderr.read() if not proc.stderr.closed else b""
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == "sparsevllm 0.1.0"
