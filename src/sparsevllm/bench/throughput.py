"""`sparsevllm bench throughput`: prefill/decode throughput against the memory roofline.

Requests of `--prompt-len` random tokens are submitted at once and the engine is
stepped by hand, so prefill steps and pure-decode steps are timed separately. The
decode roofline of a step is (weight bytes + KV bytes resident in the pool) divided
by the device's copy bandwidth, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from sparsevllm.bench.model_configs import MODEL_CONFIGS, write_model_config
from sparsevllm.llm import LLM
from sparsevllm.sampling import SamplingParams


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth in bytes/s: (read + write) of a large copy, median of runs."""
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
    return 2 * src.numel() * 4 / statistics.median(times[2:])


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every matrix once; embeddings only by row."""
    total = 0
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.endswith("embed_tokens.weight") and not model.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Submit everything, step to completion, and time prefill and pure-decode steps."""
    engine = llm.engine
    device = engine.runner.device
    engine.pool.reset_peak()
    for p in prompts:
        engine.add_request(p, params)
    decode_times: list[float] = []
    kv_layer_slots: list[int] = []  # resident slots summed over layers, per decode step
    outputs = []
    _sync(device)
    start = time.perf_counter()
    first_decode = None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        sched_before = engine.scheduler.stats.num_prefill_tokens_computed
        finished = [o for o in engine.step() if o.finished]
        _sync(device)
        dt = time.perf_counter() - t0
        outputs.extend(finished)
        if engine.scheduler.stats.num_prefill_tokens_computed == sched_before:
            first_decode = first_decode or t0
            decode_times.append(dt)
            kv_layer_slots.append(sum(engine.pool.used_per_layer()))
    total = time.perf_counter() - start
    return {
        "total_s": total,
        "prefill_s": (first_decode or time.perf_counter()) - start,
        "decode_step_times": decode_times,
        "kv_layer_slots": kv_layer_slots,
        "outputs": outputs,
    }


def bench(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    model = engine_kwargs.pop("model", None)
    if args.model_config:
        model = write_model_config(args.model_config)
        engine_kwargs.setdefault("load_format", "dummy")
    llm = LLM(model, **engine_kwargs)
    args._llm = llm  # reused by --compare to copy the same weights
    engine, runner = llm.engine, llm.engine.runner
    vocab = engine.source.hf_config.vocab_size
    batch = args.batch_size or max_batch(llm, args.prompt_len, args.output_len)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    bandwidth = measure_copy_bandwidth(runner.device)
    run = run_engine(llm, prompts, params)
    steps = run["decode_step_times"][1:] or run["decode_step_times"]  # first one warms up
    step = statistics.median(steps) if steps else float("nan")
    per_layer_bytes = runner.kv_bytes_per_slot // runner.num_layers
    kv_read = statistics.median(run["kv_layer_slots"]) * per_layer_bytes if steps else 0
    weights = weight_bytes_per_step(runner.model)
    roofline = (weights + kv_read) / bandwidth
    ttft = [o.metrics["time_to_first_token"] for o in run["outputs"]]
    stats = llm.stats()
    return {
        "model": args.model_config or model,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(runner.device)
        if runner.device.type == "cuda"
        else "cpu",
        "sparse_method": llm.config.sparse_method,
        "knobs": runner.method.knobs(),
        "prefill_policy": engine.prefill_policy,
        "chunk_prefill_size": llm.config.chunk_prefill_size,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "batch_size": batch,
        "concurrency": stats["max_concurrent_seqs"],
        "prefill_tokens_per_s": batch * args.prompt_len / run["prefill_s"],
        "decode_tokens_per_s": batch / step if steps else None,
        "end_to_end_tokens_per_s": batch * args.output_len / run["total_s"],
        "time_to_first_token_s": {"mean": statistics.mean(ttft), "max": max(ttft)},
        "time_per_output_token_s": step,
        "peak_kv_slots": stats["kv_slots_peak"],
        "peak_kv_bytes": stats["kv_slots_peak"] * runner.kv_bytes_per_slot,
        "kv_slots_total": stats["kv_slots_total"],
        "num_preemptions": stats["num_preemptions"],
        "device_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": weights,
        "kv_bytes_read_per_step": kv_read,
        "roofline_step_s": roofline,
        "roofline_fraction": roofline / step if steps else None,
        "total_s": run["total_s"],
    }


def max_batch(llm: LLM, prompt_len: int, output_len: int) -> int:
    """The largest batch whose worst-case residency fits the pool at once."""
    per_seq = llm.engine.method.max_resident(prompt_len, output_len)
    return max(1, min(llm.engine.pool.num_slots // per_seq, llm.config.max_num_seqs))


def add_parser(sub: argparse._SubParsersAction, add_engine_args: Any) -> None:
    p = sub.add_parser(
        "throughput",
        help="Prefill/decode throughput against the memory roofline.",
        description="Submit BATCH random prompts of PROMPT_LEN tokens, generate OUTPUT_LEN "
        "tokens each, and report prefill/decode throughput, TTFT, TPOT, peak KV and the decode "
        "roofline fraction (weights + resident KV bytes per step over the measured copy "
        "bandwidth, divided by the measured step time).",
    )
    p.add_argument(
        "--model-config",
        choices=sorted(MODEL_CONFIGS),
        help="A named real-shape config with dummy weights (instead of --model).",
    )
    p.add_argument(
        "--prompt-len", type=int, default=1024, help="Prompt tokens per request (default: 1024)."
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="Generated tokens per request (default: 128)."
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="Requests submitted at once (default: --max-batch).",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="Use the largest batch whose worst-case KV fits the pool (the default without --batch-size).",
    )
    p.add_argument(
        "--compare",
        choices=["hf"],
        action="append",
        default=[],
        help="Also run Hugging Face generate on the same weights and shapes and report the ratio.",
    )
    p.add_argument(
        "--bench-seed", dest="seed", type=int, default=0, help="Seed of the random prompts."
    )
    p.add_argument("--json", metavar="FILE", help="Write the report as JSON to FILE.")
    add_engine_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from sparsevllm.cli import engine_config_from_args

    config = engine_config_from_args(args)
    given = {k: v for k, v in config.to_dict().items() if k in vars(args)}
    report = bench(args, given)
    if "hf" in args.compare:
        from sparsevllm.bench.hf_compare import hf_generate_throughput

        report["hf"] = hf_generate_throughput(args, report)
        report["speedup_vs_hf_end_to_end"] = (
            report["end_to_end_tokens_per_s"] / report["hf"]["end_to_end_tokens_per_s"]
        )
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0
