"""`--compare kvpress`: the same sparse method in kvpress, same shapes, in the same run.

kvpress (NVIDIA's KV-cache compression library on Hugging Face transformers) needs
transformers < 5.3, so it runs in a child process whose PYTHONPATH starts with
`--kvpress-site`, a directory holding kvpress and a matching transformers, e.g.

    pip install --no-deps --target SITE kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2

Our engine's device memory is released first. kvpress compresses once, at the end of
the prefill, with `compression_ratio` = 1 - budget / prompt length, so the two runs hold
the same number of tokens per layer when decoding starts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

KVPRESS_METHODS = ("snapkv", "pyramidkv", "streamingllm", "knorm", "tova")


def press_settings(method: str, knobs: dict[str, Any], prompt_len: int) -> tuple[float, dict]:
    """(compression_ratio, press kwargs) that mirror our method's knobs."""
    if method not in KVPRESS_METHODS:
        raise ValueError(
            f"--compare kvpress supports {', '.join(KVPRESS_METHODS)}; {method!r} has no "
            "kvpress press here"
        )
    if method == "streamingllm":
        budget = knobs["sink_keep_tokens"] + knobs["recent_keep_tokens"]
        kwargs: dict[str, Any] = {"n_sink": knobs["sink_keep_tokens"]}
    else:
        budget = knobs["decode_keep_tokens"]
        kwargs = {}
    if method in ("snapkv", "pyramidkv"):
        kwargs |= {
            "window_size": knobs["snapkv_window_size"],
            "kernel_size": knobs["snapkv_pool_kernel_size"],
        }
    if method == "pyramidkv":
        kwargs["beta"] = knobs["pyramidkv_beta"]
    if budget >= prompt_len:
        raise ValueError(f"budget {budget} >= prompt length {prompt_len}: nothing to compress")
    return 1.0 - budget / prompt_len, kwargs


def kvpress_version(site: str) -> str:
    dist = next(Path(site).glob("kvpress-*.dist-info"), None)
    return dist.name.removeprefix("kvpress-").removesuffix(".dist-info") if dist else "?"


def kvpress_throughput(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Run kvpress in a child process on the run's shapes; returns its measurements."""
    site = args.kvpress_site
    if not site or not Path(site).is_dir():
        raise ValueError("--compare kvpress needs --kvpress-site DIR (see docs/benchmarks)")
    llm = args._llm
    model_dir = getattr(args, "_model_dir", None)
    if model_dir is None or not Path(model_dir, "config.json").is_file():
        raise ValueError("--compare kvpress needs a model directory or --model-config")
    method = report["sparse_method"]
    ratio, press_kwargs = press_settings(method, report["knobs"], report["prompt_len"])
    spec = {
        "model_dir": str(model_dir),
        "method": method,
        "compression_ratio": ratio,
        "press_kwargs": press_kwargs,
        "batch_size": args.kvpress_batch_size or report["batch_size"],
        "prompt_len": report["prompt_len"],
        "output_len": report["output_len"],
        "dtype": report["dtype"],
        "device": str(llm.engine.runner.device),
        "seed": args.seed,
        "kvpress_version": kvpress_version(site),
    }
    llm.close()  # kvpress needs the device memory
    worker = Path(__file__).with_name("kvpress_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, str(worker), "--spec", str(spec_path), "--out", str(out_path)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"kvpress worker failed:\n{done.stderr[-4000:]}")
        result = json.loads(out_path.read_text())
    result["compression_ratio"] = ratio
    return result
