"""`bench throughput --compare kvpress`: kvpress in its own environment, same shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparsevllm.bench.kvpress_compare import press_settings

# `make setup` installs kvpress with a transformers < 5.3 here (pip --target).
SITE = Path(__file__).resolve().parents[2] / ".venv" / "kvpress-site"
KNOBS = dict(
    sink_keep_tokens=4,
    recent_keep_tokens=8,
    decode_keep_tokens=64,
    snapkv_window_size=16,
    snapkv_pool_kernel_size=7,
    pyramidkv_beta=20,
)


def test_press_settings_mirror_our_knobs() -> None:
    ratio, kwargs = press_settings("snapkv", KNOBS, 256)
    assert ratio == pytest.approx(0.75) and kwargs == {"window_size": 16, "kernel_size": 7}
    ratio, kwargs = press_settings("streamingllm", KNOBS, 120)
    assert ratio == pytest.approx(0.9) and kwargs == {"n_sink": 4}
    assert press_settings("pyramidkv", KNOBS, 128)[1]["beta"] == 20
    with pytest.raises(ValueError, match="no kvpress press"):
        press_settings("quest", KNOBS, 256)
    with pytest.raises(ValueError, match="nothing to compress"):
        press_settings("knorm", KNOBS, 64)


@pytest.mark.skipif(not SITE.is_dir(), reason="kvpress site not installed (make setup)")
def test_compare_kvpress_end_to_end(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "sparsevllm.cli",
        "bench",
        "throughput",
        "--model",
        tiny_llama,
        "--prompt-len",
        "200",
        "--output-len",
        "6",
        "--batch-size",
        "2",
        "--sparse-method",
        "snapkv",
        "--decode-keep-tokens",
        "64",
        "--snapkv-window-size",
        "16",
        "--dtype",
        "float32",
        "--compare",
        "kvpress",
        "--kvpress-site",
        str(SITE),
        "--json",
        str(out),
    ]
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    kv = report["kvpress"]
    # Both hold the budget when decoding starts; kvpress ran its own SnapKV press.
    assert kv["resident_kv_tokens_per_layer"] == 64
    assert kv["compression_ratio"] == pytest.approx(1 - 64 / 200)
    assert "SnapKVPress" in kv["impl"] and kv["decode_tokens_per_s"] > 0
    assert report["decode_speedup_vs_kvpress"] > 0
