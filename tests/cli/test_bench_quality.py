"""`sparsevllm bench quality` end to end (subprocess, as a user would run it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")
FLAGS = [
    "--tasks",
    "--lengths",
    "--samples",
    "--methods",
    "--ratios",
    "--seed",
    "--modes",
    "--query-agnostic",
    "--model",
    "--chat",
    "--max-tokens",
    "--json",
    "--records",
    "--plot",
    "--no-progress",
    "--config",
    "--dtype",
    "--device",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--chunk-prefill-size",
    "--max-model-len",
    "--kv-cache-memory-gb",
    "--num-kv-slots",
    "--enforce-eager",
]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", "bench", "quality", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_help_lists_every_flag() -> None:
    out = cli("--help")
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag in out.stdout, flag
    assert "round((1 - r) * length)" in out.stdout
    assert "query_agnostic: two turns" in " ".join(out.stdout.split())


def test_query_agnostic_runs_two_turns(tiny_llama: str, tmp_path: Path) -> None:
    args = ["--model", tiny_llama, "--tasks", "niah_single", "--lengths", "128", "--samples"]
    args += ["2", "--methods", "vanilla,snapkv", "--ratios", "0.5", "--max-tokens", "4"]
    args += ["--json", str(tmp_path / "q.json"), "--no-progress", "--query-agnostic"]
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "q.json").read_text())
    assert report["metadata"]["modes"] == ["query_agnostic"]
    assert {r["mode"] for r in report["results"]} == {"query_agnostic"}
    records = [json.loads(x) for x in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert [r["chain_status"] for r in records if r["method"] == "snapkv"] == ["continued"] * 2
    both = cli(*args[:-1], "--modes", "query_aware,query_agnostic")  # adds query-aware only
    assert both.returncode == 0, both.stderr
    assert "query_aware:" in both.stdout and "query_agnostic:" in both.stdout
    report = json.loads((tmp_path / "q.json").read_text())
    assert {e["mode"] for e in report["metadata"]["engines_run"]} == {"query_aware"}
    clash = cli(*args, "--modes", "query_aware")
    assert clash.returncode == 2 and "not allowed with argument" in clash.stderr


def test_small_run_writes_json_records_and_plot(tiny_llama: str, tmp_path: Path) -> None:
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"snapkv_window_size": 8}))
    args = ["--model", tiny_llama, "--tasks", "niah_single,niah_multikey", "--lengths", "128"]
    args += ["--samples", "2", "--methods", "vanilla,snapkv,streaming", "--ratios", "0.5,0.75"]
    args += ["--json", str(tmp_path / "q.json"), "--plot", str(tmp_path / "q.png")]
    args += ["--config", str(config), "--max-num-seqs", "4", "--max-tokens", "4", "--no-progress"]
    out = cli(*args)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "q.json").read_text())
    assert len(report["results"]) == 2 * (1 + 2 + 2)  # tasks x cells
    assert report["metadata"]["engine"]["snapkv_window_size"] == 8
    knobs = {(e["method"], e["ratio"]): e["knobs"] for e in report["metadata"]["engines_run"]}
    assert knobs[("snapkv", 0.75)]["decode_keep_tokens"] == 32
    assert knobs[("snapkv", 0.75)]["snapkv_window_size"] == 8
    assert len((tmp_path / "q.jsonl").read_text().splitlines()) == 2 * 2 * 5
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"
    assert "| streamingllm | 0.75 |" in out.stdout  # the markdown table

    again = cli(*args)  # resumed: nothing left to run
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "q.json").read_text())["metadata"]["engines_run"] == []


def test_unknown_names_suggest_the_closest(tiny_llama: str, tmp_path: Path) -> None:
    out = cli("--model", tiny_llama, "--tasks", "niah_multikye", "--json", str(tmp_path / "q"))
    assert out.returncode == 2 and "did you mean 'niah_multikey'" in out.stderr
    out = cli("--model", tiny_llama, "--methods", "snapvk", "--json", str(tmp_path / "q"))
    assert out.returncode == 2 and "did you mean 'snapkv'" in out.stderr
    assert "Traceback" not in out.stderr
