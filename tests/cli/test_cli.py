"""End-to-end CLI tests (subprocess, as a user would run it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    text = cli("methods")
    assert text.returncode == 0 and "quest" in text.stdout
