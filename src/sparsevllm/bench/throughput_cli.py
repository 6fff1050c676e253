"""`sparsevllm bench throughput`, the command: its flags, and running one point, a
sweep of prompt lengths, or a comparison with HF / kvpress (the measurement itself is
bench/throughput.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tqdm import tqdm

from sparsevllm.bench.capacity import add_capacity_argument
from sparsevllm.bench.model_configs import MODEL_CONFIGS
from sparsevllm.bench.roofline import measure_copy_bandwidth
from sparsevllm.bench.throughput import bench, build_llm, measure


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
        "--sweep-prompt-lens",
        metavar="N,N,...",
        help="Measure several prompt lengths with one engine (shortest first; the JSON is "
        "then a list of reports, one per length, for python -m sparsevllm.bench.sweep). "
        "--max-model-len must cover the longest.",
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
    add_capacity_argument(p)
    p.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="Batch for --compare hf (default: the same batch).",
    )
    p.add_argument(
        "--compare",
        choices=["hf", "kvpress"],
        action="append",
        default=[],
        help="Also run Hugging Face generate on the same weights and shapes (hf), or the "
        "same sparse method in kvpress (kvpress, needs --kvpress-site), and report the ratio; "
        "may be given twice.",
    )
    p.add_argument(
        "--kvpress-site",
        metavar="DIR",
        help="Directory with kvpress and a transformers < 5.3 installed (pip --target), "
        "put first on the kvpress process's PYTHONPATH.",
    )
    p.add_argument(
        "--kvpress-batch-size",
        type=int,
        default=None,
        help="Batch for --compare kvpress (default: the same batch).",
    )
    p.add_argument(
        "--bench-seed", dest="seed", type=int, default=0, help="Seed of the random prompts."
    )
    p.add_argument("--json", metavar="FILE", help="Write the report as JSON to FILE.")
    add_engine_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from sparsevllm.engine_args import engine_config_from_args

    if args.decode_capacity is not None and args.compare:
        raise SystemExit(
            "--compare runs the other engine end to end on the whole batch, prefill included: "
            "drop --decode-capacity"
        )
    config = engine_config_from_args(args)
    given = {k: v for k, v in config.to_dict().items() if k in vars(args)}
    if args.sweep_prompt_lens:
        return run_sweep(args, given)
    report = bench(args, given)
    if "hf" in args.compare:
        from sparsevllm.bench.hf_compare import hf_generate_throughput

        report["hf"] = hf_generate_throughput(args, report)
        report["speedup_vs_hf_end_to_end"] = (
            report["end_to_end_tokens_per_s"] / report["hf"]["end_to_end_tokens_per_s"]
        )
        # HF's prefill is SDPA attention plus the same matmuls: the prefill target's base.
        report["prefill_ratio_vs_hf"] = (
            report["prefill_tokens_per_s"] / report["hf"]["prefill_tokens_per_s"]
        )
    if "kvpress" in args.compare:
        from sparsevllm.bench.kvpress_compare import kvpress_throughput

        report["kvpress"] = kvpress_throughput(args, report)
        report["decode_speedup_vs_kvpress"] = (
            report["decode_tokens_per_s"] / report["kvpress"]["decode_tokens_per_s"]
        )
        report["end_to_end_speedup_vs_kvpress"] = (
            report["end_to_end_tokens_per_s"] / report["kvpress"]["end_to_end_tokens_per_s"]
        )
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def run_sweep(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """--sweep-prompt-lens: one engine, one report per prompt length."""
    try:
        lens = sorted({int(x) for x in args.sweep_prompt_lens.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(
            f"--sweep-prompt-lens: not a list of integers: {args.sweep_prompt_lens}"
        ) from None
    if not lens or min(lens) < 1:
        raise SystemExit("--sweep-prompt-lens needs positive lengths")
    if args.compare:
        raise SystemExit("--compare runs one prompt length: drop --sweep-prompt-lens")
    llm = build_llm(args, engine_kwargs)
    bandwidth = measure_copy_bandwidth(llm.engine.runner.device)
    reports = []
    for n in tqdm(lens, desc="prompt lengths"):
        reports.append(measure(args, llm, n, bandwidth))
    text = json.dumps(reports, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    for r in reports:
        tps = r["decode_tokens_per_s"]
        print(
            f"{r['sparse_method']:12s} {r['prompt_len']:7d} tokens  batch {r['batch_size']:3d}  "
            f"decode {tps if tps is None else round(tps, 1)} tok/s"
        )
    return 0
