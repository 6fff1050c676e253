"""kvpress side of `bench throughput --compare kvpress`, run as a separate process.

kvpress needs transformers < 5.3 while the engine needs a newer one, so this file is run
by path (not as part of the `sparsevllm` package, which it never imports) with the
directory given by `--kvpress-site` first on PYTHONPATH:

    python kvpress_worker.py --spec spec.json --out result.json

It builds the model from `spec["model_dir"]` (config.json; random weights: only speed
is compared), prefills a batch of random prompts under the kvpress press, which
compresses the KV cache at the end of the prefill, then decodes greedily and times every
step, the way kvpress's own pipeline drives a model (explicit position ids after the
compression). The result JSON holds prefill time, decode step times and the resident KV.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import statistics
import sys
import time
import types
from typing import Any

# our method -> (kvpress module, press class)
PRESSES = {
    "snapkv": ("snapkv_press", "SnapKVPress"),
    "pyramidkv": ("pyramidkv_press", "PyramidKVPress"),
    "streamingllm": ("streaming_llm_press", "StreamingLLMPress"),
    "knorm": ("knorm_press", "KnormPress"),
    "tova": ("tova_press", "TOVAPress"),
}


def bare_kvpress_package() -> None:
    """Make `kvpress.*` submodules importable without running `kvpress/__init__.py`, which
    imports every press and with them optional dependencies (datasets, fire, ...)."""
    if "kvpress" not in sys.modules:
        spec = importlib.util.find_spec("kvpress")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("kvpress is not importable: check --kvpress-site")
        pkg = types.ModuleType("kvpress")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["kvpress"] = pkg


def load_press_class(method: str) -> type:
    """The press class (through `bare_kvpress_package`)."""
    bare_kvpress_package()
    module, cls = PRESSES[method]
    return getattr(importlib.import_module(f"kvpress.presses.{module}"), cls)


def _sync(torch: Any, device: Any) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    torch.manual_seed(spec["seed"])
    config = AutoConfig.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    press = load_press_class(spec["method"])(
        compression_ratio=spec["compression_ratio"], **spec["press_kwargs"]
    )
    batch, plen, olen = spec["batch_size"], spec["prompt_len"], spec["output_len"]
    gen = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, config.vocab_size, (batch, plen), generator=gen).to(device)

    def generate(prompt: Any, steps: int) -> tuple[float, list[float], int]:
        cache = DynamicCache()
        t0 = _sync(torch, device)
        with torch.inference_mode(), press(model):
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = _sync(torch, device) - t0
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        resident = cache.layers[0].keys.shape[2]
        times = []
        for i in range(steps):
            pos = torch.full((prompt.shape[0], 1), prompt.shape[1] + i, device=device)
            t0 = _sync(torch, device)
            with torch.inference_mode():
                out = model(token, past_key_values=cache, use_cache=True, position_ids=pos)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(_sync(torch, device) - t0)
        return prefill, times, resident

    generate(ids[:1, : min(plen, 256)], 2)  # warm up kernels
    prefill, times, resident = generate(ids, olen - 1)
    step = statistics.median(times[1:] or times)
    return {
        "impl": f"kvpress {spec['kvpress_version']} {PRESSES[spec['method']][1]} "
        f"(transformers {transformers.__version__}, DynamicCache)",
        "press": repr(press),
        "batch_size": batch,
        "prefill_s": prefill,
        "prefill_tokens_per_s": batch * plen / prefill,
        "decode_step_s": step,
        "decode_tokens_per_s": batch / step,
        "total_s": prefill + sum(times),
        "end_to_end_tokens_per_s": batch * olen / (prefill + sum(times)),
        "resident_kv_tokens_per_layer": resident,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvpress side of bench throughput --compare kvpress")
    p.add_argument("--spec", required=True, help="JSON file with the run's settings")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    result = run(spec)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
