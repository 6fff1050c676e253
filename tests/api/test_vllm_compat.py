"""A script written for vLLM's offline API runs unchanged (acceptance 3 of issue 24)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = str(HERE.parents[1] / "src")


def test_vllm_offline_script_runs_unchanged(tiny_llama):
    env = {**os.environ, "PYTHONPATH": SRC, "MODEL": tiny_llama}
    out = subprocess.run(
        [sys.executable, str(HERE / "vllm_offline_example.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Generated text:") == 2 and out.stdout.rstrip().endswith("OK")
