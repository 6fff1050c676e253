"""`sparsevllm bench moe`: one mixture-of-experts layer, fused Triton kernel against the
per-expert loop, at several token counts (CUDA).

For each token count T: random hidden states and router logits, the layer's experts
with dummy weights of the model config's shapes, and

* `fused_ms`: `fused_moe` (routing included: the softmax/top-k and the device-side sort),
  eager and replayed from a CUDA graph (`fused_graph_ms`: no host launch overhead; the
  layer is graph-safe, which the capture itself checks);
* `loop_ms`: the torch reference, one GEMM pair per routed expert (what an engine
  without a grouped kernel runs; it reads the routing back to the host);
* `floor_ms`: the bytes of the experts this step actually routes to (counted from the
  routing) plus activations, over the measured copy bandwidth; `fused_floor_fraction`
  = floor / fused graph time;
* `rel_err`: fused against the loop (relative L2);
* `block_sizes_ms`: the graph time of other (BLOCK_M, BLOCK_N, BLOCK_K) choices, against
  the automatic one (`auto_block_sizes`), to tune `moe_block_sizes`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from sparsevllm.bench.model_configs import MODEL_CONFIGS
from sparsevllm.layers.moe import reference_experts, route


def _median_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=100, return_mode="median"))


def _graph_ms(fn: Any) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _median_ms(graph.replay)


def _copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_median_ms(lambda: dst.copy_(src)) * 1e-3)


def layer_shapes(name: str) -> dict[str, Any]:
    cfg = MODEL_CONFIGS[name]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ValueError(f"model config {name!r} has no experts")
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return {
        "hidden": cfg["hidden_size"],
        "intermediate": inter,
        "experts": experts,
        "top_k": cfg["num_experts_per_tok"],
        "normalize": bool(cfg.get("norm_topk_prob", cfg["model_type"] == "mixtral")),
    }


# (BLOCK_M, BLOCK_N, BLOCK_K) tried besides the automatic choice: 16-row blocks where the
# automatic choice is 16 rows (decode), larger ones elsewhere.
CANDIDATE_BLOCK_SIZES = [
    (16, 32, 128),
    (16, 64, 64),
    (16, 64, 128),
    (16, 64, 256),
    (16, 128, 128),
    (32, 64, 64),
    (64, 64, 64),
    (64, 128, 64),
    (128, 128, 64),
]


def bench_tokens(
    shapes: dict[str, Any], weights: tuple[torch.Tensor, torch.Tensor], t: int, bw: float
) -> dict[str, Any]:
    from sparsevllm.attention.triton.moe import fused_moe, moe_block_sizes

    gate_up, down = weights
    device, dtype = gate_up.device, gate_up.dtype
    gen = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, shapes["hidden"], device=device, dtype=dtype, generator=gen)
    logits = torch.randn(t, shapes["experts"], device=device, dtype=dtype, generator=gen)

    def fused() -> torch.Tensor:
        w, ids = route(logits, shapes["top_k"], shapes["normalize"])
        return fused_moe(x, gate_up, down, w, ids)

    def loop() -> torch.Tensor:
        w, ids = route(logits, shapes["top_k"], shapes["normalize"])
        return reference_experts(x, gate_up, down, w, ids)

    out, ref = fused(), loop()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    _, ids = route(logits, shapes["top_k"], shapes["normalize"])
    active = int(torch.unique(ids).numel())
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    act_bytes = 2 * t * shapes["hidden"] * x.element_size()  # x in, y out
    floor = (active * expert_bytes + act_bytes) / bw * 1e3
    graph = _graph_ms(fused)
    auto = moe_block_sizes(t * shapes["top_k"], shapes["experts"])
    sweep: dict[str, float | str] = {}
    for sizes in CANDIDATE_BLOCK_SIZES:
        if sizes != auto and (sizes[0] == 16) == (auto[0] == 16):

            def run(sizes: tuple[int, int, int] = sizes) -> torch.Tensor:
                w, ids = route(logits, shapes["top_k"], shapes["normalize"])
                return fused_moe(x, gate_up, down, w, ids, block_sizes=sizes)

            try:
                sweep["x".join(map(str, sizes))] = _graph_ms(run)
            except Exception as e:  # e.g. Triton's OutOfResources: too much shared memory
                sweep["x".join(map(str, sizes))] = f"{type(e).__name__}: {e}"[:200]
    return {
        "tokens": t,
        "auto_block_sizes": "x".join(map(str, auto)),
        "block_sizes_ms": sweep,
        "active_experts": active,
        "fused_ms": _median_ms(fused),
        "fused_graph_ms": graph,
        "loop_ms": _median_ms(loop),
        "floor_ms": floor,
        "fused_floor_fraction": floor / graph,
        "rel_err": err,
    }


def run_cli(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("bench moe needs a CUDA GPU (the fused kernel's timings)")
    device = torch.device("cuda")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    shapes = layer_shapes(args.model_config)
    try:
        tokens = [int(v) for v in args.tokens.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tokens: not a list of integers: {args.tokens}") from None
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = shapes["experts"], shapes["hidden"], shapes["intermediate"]
    gate_up = torch.randn(e, 2 * i, h, device=device, generator=gen).mul_(0.02).to(dtype)
    down = torch.randn(e, h, i, device=device, generator=gen).mul_(0.02).to(dtype)
    bw = _copy_bandwidth(device)
    rows = [bench_tokens(shapes, (gate_up, down), t, bw) for t in tokens]
    report = {
        "model_config": args.model_config,
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        **shapes,
        "device_bandwidth_bytes_per_s": bw,
        "rows": rows,
    }
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe",
        help="One MoE layer: fused Triton kernel vs the per-expert loop (CUDA).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    moe_configs = sorted(
        n for n, c in MODEL_CONFIGS.items() if c.get("num_experts") or c.get("num_local_experts")
    )
    p.add_argument("--model-config", choices=moe_configs, default="qwen3-30b-a3b")
    p.add_argument(
        "--tokens",
        default="1,16,64,256,1024,4096",
        help="Token counts per layer call, comma-separated (decode batch or prefill chunk).",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--json", metavar="FILE", help="Write the report as JSON to FILE.")
    p.set_defaults(func=run_cli)
