"""`sparsevllm` command line: generate, methods (serve and bench come with their issues)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from sparsevllm.engine_args import add_engine_args, engine_config_from_args

_SAMPLING_FLAGS: list[tuple[str, type, Any, str]] = [
    ("max_tokens", int, 128, "Most tokens to generate per prompt."),
    ("temperature", float, 0.0, "Sampling temperature; 0 is greedy."),
    ("top_p", float, 1.0, "Nucleus sampling: keep the smallest set of tokens with this mass."),
    ("top_k", int, 0, "Keep only the k most likely tokens (0: all)."),
    ("min_p", float, 0.0, "Drop tokens less likely than min_p times the top token."),
    ("repetition_penalty", float, 1.0, "Penalise tokens already in prompt or output (>1)."),
    ("presence_penalty", float, 0.0, "OpenAI presence penalty over output tokens."),
    ("frequency_penalty", float, 0.0, "OpenAI frequency penalty over output tokens."),
    ("sampling_seed", int, None, "Per-request sampling seed (reproducible sampling)."),
    ("logprobs", int, None, "Return the log-probabilities of the top-N tokens per step."),
]


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="Generate text for prompts or chat messages.",
        description="Generate from one or more prompts (or chat messages) and print the text, "
        "throughput and KV usage. Example: sparsevllm generate --chat 'Hi!' --max-tokens 64",
    )
    src = p.add_argument_group("input")
    src.add_argument("--prompt", action="append", default=[], help="A raw prompt (repeatable).")
    src.add_argument(
        "--chat",
        action="append",
        default=[],
        help="A user message, sent through the chat template (repeatable: one conversation each).",
    )
    src.add_argument("--system", help="System message for --chat conversations.")
    src.add_argument("--prompt-file", help="A file with one prompt per line.")
    src.add_argument(
        "--random-prompt-tokens",
        type=int,
        metavar="N",
        help="Use random token-id prompts of N tokens (throughput tests).",
    )
    src.add_argument(
        "--batch-size", type=int, default=1, help="Repeat each prompt this many times (default: 1)."
    )
    samp = p.add_argument_group("sampling")
    for name, kind, default, help_text in _SAMPLING_FLAGS:
        samp.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=f"{help_text} (default: {default})",
        )
    samp.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    samp.add_argument("--ignore-eos", action="store_true", help="Keep generating after EOS.")
    out = p.add_argument_group("output")
    out.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON object (outputs, stats, throughput) instead of text.",
    )
    out.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    add_engine_args(p)
    p.set_defaults(func=run_generate)


def _sampling_params(args: argparse.Namespace):
    from sparsevllm.sampling import SamplingParams

    values = {name: getattr(args, name) for name, *_ in _SAMPLING_FLAGS}
    values["seed"] = values.pop("sampling_seed")
    return SamplingParams(**values, stop=args.stop, ignore_eos=args.ignore_eos)


def _collect_prompts(args: argparse.Namespace, llm: Any) -> list[Any]:
    prompts: list[Any] = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    for message in args.chat:
        conv = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": message}
        ]
        prompts.append(llm.apply_chat_template(conv))
    if args.random_prompt_tokens:
        import random

        rng = random.Random(0)
        vocab = llm.engine.source.hf_config.vocab_size
        prompts.append([rng.randrange(vocab) for _ in range(args.random_prompt_tokens)])
    if not prompts:
        raise SystemExit("error: give --prompt, --chat, --prompt-file or --random-prompt-tokens")
    return [p for p in prompts for _ in range(args.batch_size)]


def run_generate(args: argparse.Namespace) -> int:
    from sparsevllm.llm import LLM

    config = engine_config_from_args(args)
    params = _sampling_params(args)
    llm = LLM(config)
    prompts = _collect_prompts(args, llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    n_out = sum(len(o.token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    ttft = [o.metrics["time_to_first_token"] for o in outputs]
    decode_span = max(o.metrics["e2e_latency"] for o in outputs) - min(ttft)
    summary = {
        "num_requests": len(outputs),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "decode_tokens_per_s": (n_out - len(outputs)) / decode_span if decode_span > 0 else None,
        "mean_time_to_first_token_s": sum(ttft) / len(ttft),
    }
    if args.json:
        report = {
            "config": config.to_dict(),
            "outputs": [
                {
                    "prompt": o.prompt,
                    "text": o.text,
                    "token_ids": o.token_ids,
                    "prompt_tokens": len(o.prompt_token_ids),
                    "finish_reason": o.finish_reason,
                    "metrics": o.metrics,
                }
                for o in outputs
            ],
            "summary": summary,
            "stats": stats,
        }
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    for i, o in enumerate(outputs):
        print(
            f"--- output {i} ({len(o.prompt_token_ids)} prompt tokens, {len(o.token_ids)} "
            f"generated, finish: {o.finish_reason})"
        )
        print(o.text)
    dec = summary["decode_tokens_per_s"]
    print(
        f"--- {n_out} tokens in {elapsed:.2f} s: {summary['output_tokens_per_s']:.1f} tok/s overall, "
        f"{dec:.1f} tok/s decode, TTFT {summary['mean_time_to_first_token_s'] * 1000:.0f} ms; "
        f"KV slots peak {stats['kv_slots_peak']} of {stats['kv_slots_total']} per layer"
        if dec is not None
        else f"--- {n_out} tokens in {elapsed:.2f} s"
    )
    return 0


def _add_methods(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "methods",
        help="List the sparse methods.",
        description="List the registered KV sparsity methods.",
    )
    p.add_argument("--json", action="store_true", help="Print JSON.")
    p.set_defaults(func=run_methods)


def run_methods(args: argparse.Namespace) -> int:
    from sparsevllm.sparse.registry import methods_table

    rows = methods_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'method':13s} {'family':22s} {'prefill policy':25s} knobs (defaults)")
    for r in rows:
        knobs = ", ".join(f"{k}={v}" for k, v in r["knobs"].items()) or "-"
        print(f"{r['name']:13s} {r['family']:22s} {r['prefill_policy']:25s} {knobs}")
        aliases = f" (aliases: {', '.join(r['aliases'])})" if r["aliases"] else ""
        print(f"{'':13s} {r['description']}{aliases}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from sparsevllm.server import defaults

    p = sub.add_parser(
        "serve",
        help="Run the OpenAI-compatible HTTP server.",
        description="Serve /v1/models, /v1/completions, /v1/chat/completions, /health and "
        "/metrics (OpenAI-compatible; see docs/server.md). Example: sparsevllm serve "
        "--model ./my-model --port 8000 --sparse-method snapkv",
    )
    srv = p.add_argument_group("server")
    srv.add_argument(
        "--host",
        default=defaults.DEFAULT_HOST,
        help=f"Address to bind (default: {defaults.DEFAULT_HOST}).",
    )
    srv.add_argument(
        "--port",
        type=int,
        default=defaults.DEFAULT_PORT,
        help=f"TCP port (default: {defaults.DEFAULT_PORT}).",
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("SPARSEVLLM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1 routes (default: $SPARSEVLLM_API_KEY; "
        "unset: no authentication).",
    )
    srv.add_argument(
        "--served-model-name",
        help="Model name clients send and responses carry (default: the --model path, or "
        "the bundled default model's name).",
    )
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=defaults.DEFAULT_MAX_QUEUE_LEN,
        help="Most requests waiting for the engine; beyond it requests get HTTP 429 "
        f"(default: {defaults.DEFAULT_MAX_QUEUE_LEN}).",
    )
    srv.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.DEFAULT_SHUTDOWN_GRACE_S,
        help="On SIGINT/SIGTERM, seconds running requests may take to finish before they are "
        f"aborted (default: {defaults.DEFAULT_SHUTDOWN_GRACE_S}).",
    )
    srv.add_argument(
        "--server-log-level",
        default="info",
        choices=defaults.LOG_LEVELS,
        help="Log level of uvicorn (access log included) and of the server (default: info).",
    )
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        from sparsevllm.server.launcher import run_server
    except ImportError as e:  # fastapi/uvicorn are not core dependencies
        raise SystemExit(f"error: serve needs fastapi and uvicorn ({e}); pip install them") from e

    return run_server(
        engine_config_from_args(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_queue_len=args.max_queue_len,
        shutdown_grace_s=args.shutdown_grace_s,
        log_level=args.server_log_level,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsevllm",
        description="Sparse-vLLM: a sparse-first LLM inference engine.",
    )
    parser.add_argument("--log-level", default="WARNING", help="Logging level (default: WARNING).")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_methods(sub)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from sparsevllm.bench import multiturn, throughput
    from sparsevllm.bench.quality import cli as quality

    p = sub.add_parser(
        "bench",
        help="Benchmarks: throughput, multiturn, quality.",
        description="Benchmarks that write JSON reports (see docs/benchmarks/).",
    )
    kinds = p.add_subparsers(dest="bench", required=True)
    throughput.add_parser(kinds, add_engine_args)
    multiturn.add_parser(kinds, add_engine_args)
    quality.add_parser(kinds)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
