"""`--compare hf`: Hugging Face `generate` on the same weights, batch and lengths."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch


def _timed(fn: Any, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def hf_generate_throughput(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any]:
    """Greedy `generate` with a static cache; decode rate = (total - prefill) time."""
    from transformers import AutoModelForCausalLM

    llm = args._llm
    runner = llm.engine.runner
    ours = runner.model
    runner.free_device_memory()  # our KV pool and graphs: transformers needs the room
    # Built on the device: initialising 8B random weights on the host takes minutes.
    with torch.device(runner.device):
        hf = AutoModelForCausalLM.from_config(ours.config, dtype=runner.dtype).eval()
    # assign=True: transformers' parameters become our tensors (the same weights, no
    # copy) and its own random ones are freed, so a 30B model fits twice only briefly
    # and the static cache gets the room.
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False, assign=True)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weights do not map onto transformers: {missing} {unexpected}")
    hf.tie_weights()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    batch = args.hf_batch_size or report["batch_size"]
    plen, olen = report["prompt_len"], report["output_len"]
    vocab = ours.config.vocab_size
    rng = random.Random(args.seed)
    ids = torch.tensor(
        [[rng.randrange(vocab) for _ in range(plen)] for _ in range(batch)], device=runner.device
    )
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")

    def gen(n: int) -> None:
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **common)

    try:
        gen(2)  # warm up kernels and the static cache
        prefill = _timed(lambda: gen(1), runner.device)
        total = _timed(lambda: gen(olen), runner.device)
    except torch.OutOfMemoryError as exc:
        # transformers prefills the whole batch in one forward: its activations, beside
        # the static cache, can outgrow a device that our chunked prefill fits.
        raise SystemExit(
            f"--compare hf: transformers ran out of device memory at batch {batch} x "
            f"{plen} tokens (it prefills the whole batch at once); pass a smaller "
            f"--hf-batch-size (its rates are per token, so they stay comparable)"
        ) from exc
    decode = max(total - prefill, 1e-9)
    return {
        "impl": "transformers.generate(static cache)",
        # Mixture-of-experts models: transformers' expert kernels ("grouped_mm" on GPUs
        # that have it, else a loop over the experts).
        "experts_implementation": getattr(hf.config, "_experts_implementation_internal", None),
        "batch_size": batch,
        "prefill_tokens_per_s": batch * plen / prefill,
        "prefill_s": prefill,
        "total_s": total,
        "end_to_end_tokens_per_s": batch * olen / total,
        "decode_tokens_per_s": batch * (olen - 1) / decode,
        "time_per_output_token_s": decode / (olen - 1),
    }
