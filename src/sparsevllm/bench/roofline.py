"""What a decode step must read, and how fast the device reads: the byte count and the
measured copy bandwidth behind `bench throughput`'s roofline.

A step reads every weight once (embeddings only by row; of a mixture-of-experts layer
only the experts its tokens are routed to) and every resident KV byte once; the floor is
those bytes over the device's measured copy bandwidth.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sparsevllm.layers.moe import SparseMoeBlock
from sparsevllm.layers.moe_shared import SharedExpertsMoeBlock


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth in bytes/s: (read + write) of a large copy, the fastest of
    the runs after two warm-ups. The fastest, not the median: the roofline is the best
    the device achieves, and a median taken while the clocks vary (3% between two runs
    on the H200) let a decode step beat its own roofline (fraction 1.005)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / min(times[2:])


# Routed-expert blocks (`gate` with `top_k`, stacked `experts`): a decode step reads only
# the experts its tokens are routed to; shared experts and dense MLPs are read whole.
MOE_BLOCKS = (SparseMoeBlock, SharedExpertsMoeBlock)


def expected_active_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts that `num_tokens` tokens, each routed to `top_k` distinct
    experts uniformly at random, activate: E * (1 - (1 - k/E)^T). 64 tokens x 8 of 128
    experts: 125.9 (nearly all); one token: k."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def active_expert_fractions(model: torch.nn.Module, batch: int) -> dict[int, float]:
    """id(parameter) -> the fraction of a MoE layer's experts one decode step of `batch`
    tokens reads (the expected distinct experts under uniform routing, over all)."""
    fractions: dict[int, float] = {}
    for module in model.modules():
        if isinstance(module, MOE_BLOCKS):
            experts = module.gate.weight.shape[0]
            active = expected_active_experts(experts, module.gate.top_k, batch)
            for p in module.experts.parameters():
                fractions[id(p)] = active / experts
    return fractions


def weight_bytes_per_step(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes of weights a decode step of `batch` tokens reads: every matrix once,
    embeddings only by row, and of a mixture-of-experts layer only the experts the
    step's tokens are routed to (`active_expert_fractions`)."""
    fractions = active_expert_fractions(model, batch)
    total = 0.0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size() * fractions.get(id(p), 1.0)
    return int(total)


def moe_report(model: torch.nn.Module, batch: int) -> dict[str, Any] | None:
    """What the roofline assumed of a mixture-of-experts model (None for dense ones)."""
    blocks = [m for m in model.modules() if isinstance(m, MOE_BLOCKS)]
    if not blocks:
        return None
    experts, top_k = blocks[0].gate.weight.shape[0], blocks[0].gate.top_k
    return {
        "moe_layers": len(blocks),
        "experts": experts,
        "experts_per_token": top_k,
        "active_experts_per_layer": expected_active_experts(experts, top_k, batch),
        "active_experts_rule": "expected distinct experts of the step's tokens, uniform routing",
        "weight_bytes_all_experts": weight_bytes_per_step(model, batch=1 << 30),
    }
