"""`sparsevllm generate`: its flags, its input checks (before any model is loaded) and
its report (text, or one JSON object)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparsevllm.cli_errors import UsageError

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
    (
        "logprobs",
        int,
        None,
        "Report each generated token's logprob and the top-N alternatives (0: only the "
        "chosen token's).",
    ),
]


def add_generate_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
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


@dataclass
class GenerateInputs:
    """What the flags ask to generate from, read and checked before the model loads."""

    texts: list[str]  # --prompt and the --prompt-file lines
    chats: list[str]
    random_tokens: int | None
    batch_size: int


def read_inputs(args: argparse.Namespace) -> GenerateInputs:
    """The prompts of the command line; UsageError for anything that can never run."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.random_prompt_tokens is not None and args.random_prompt_tokens < 1:
        raise UsageError(f"--random-prompt-tokens must be >= 1, got {args.random_prompt_tokens}")
    if any(p == "" for p in args.prompt):
        raise UsageError("--prompt is empty: give the text to continue")
    if args.system and not args.chat:
        raise UsageError("--system applies to --chat conversations; give --chat too")
    texts = list(args.prompt)
    if args.prompt_file:
        texts += _prompt_file_lines(args.prompt_file)
    if not (texts or args.chat or args.random_prompt_tokens):
        raise UsageError("give --prompt, --chat, --prompt-file or --random-prompt-tokens")
    return GenerateInputs(texts, list(args.chat), args.random_prompt_tokens, args.batch_size)


def _prompt_file_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise UsageError(f"prompt file {path!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"prompt file {path!r} cannot be read: {e}") from None
    if not lines:
        raise UsageError(f"prompt file {path!r} has no prompts (one per line)")
    return lines


def build_prompts(inputs: GenerateInputs, system: str | None, llm: Any) -> list[Any]:
    """Text, chat-templated and random prompts, each repeated --batch-size times."""
    prompts: list[Any] = list(inputs.texts)
    for message in inputs.chats:
        conv = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": message}
        ]
        prompts.append(llm.apply_chat_template(conv))
    if inputs.random_tokens:
        import random

        rng = random.Random(0)
        vocab = llm.engine.source.hf_config.vocab_size
        prompts.append([rng.randrange(vocab) for _ in range(inputs.random_tokens)])
    return [p for p in prompts for _ in range(inputs.batch_size)]


def sampling_params(args: argparse.Namespace) -> Any:
    from sparsevllm.sampling import SamplingParams

    values = {name: getattr(args, name) for name, *_ in _SAMPLING_FLAGS}
    values["seed"] = values.pop("sampling_seed")
    return SamplingParams(**values, stop=args.stop, ignore_eos=args.ignore_eos)


def run_generate(args: argparse.Namespace) -> int:
    from sparsevllm.engine_args import engine_config_from_args

    inputs = read_inputs(args)
    params = sampling_params(args)
    config = engine_config_from_args(args)
    from sparsevllm.llm import LLM

    llm = LLM(config)
    prompts = build_prompts(inputs, args.system, llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    summary = _summary(outputs, time.perf_counter() - start) | _runtime(llm)
    stats = llm.stats()
    if args.json:
        report = {
            "config": config.to_dict(),
            "outputs": [_output_json(o, llm.tokenizer) for o in outputs],
            "summary": summary,
            "stats": stats,
        }
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    _print_text(outputs, summary, stats, llm.tokenizer)
    return 0


def _runtime(llm: Any) -> dict[str, Any]:
    """Where and in what the engine computed (dtype auto resolves per device and CPU)."""
    import torch

    runner = llm.engine.runner
    threads = torch.get_num_threads() if runner.device.type == "cpu" else None
    return {
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "cpu_threads": threads,
    }


def _summary(outputs: list[Any], elapsed: float) -> dict[str, Any]:
    n_out = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics["time_to_first_token"] for o in outputs]
    decode_span = max(o.metrics["e2e_latency"] for o in outputs) - min(ttft)
    return {
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": n_out,
        "elapsed_s": elapsed,
        "output_tokens_per_s": n_out / elapsed,
        "decode_tokens_per_s": (n_out - len(outputs)) / decode_span if decode_span > 0 else None,
        "mean_time_to_first_token_s": sum(ttft) / len(ttft),
    }


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _logprobs_json(entries: list[Any] | None, tokenizer: Any) -> list[dict[str, Any]] | None:
    if entries is None:
        return None

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token_id": token_id, "token": _token_text(tokenizer, token_id), "logprob": logprob}

    return [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
        for e in entries
    ]


def _output_json(o: Any, tokenizer: Any) -> dict[str, Any]:
    return {
        "prompt": o.prompt,
        "text": o.text,
        "token_ids": o.token_ids,
        "prompt_tokens": len(o.prompt_token_ids),
        "finish_reason": o.finish_reason,
        "logprobs": _logprobs_json(o.logprobs, tokenizer),
        "cumulative_logprob": o.cumulative_logprob,
        "metrics": o.metrics,
    }


def _print_text(outputs: list[Any], summary: dict[str, Any], stats: dict, tokenizer: Any) -> None:
    for i, o in enumerate(outputs):
        print(
            f"--- output {i} ({len(o.prompt_token_ids)} prompt tokens, {len(o.token_ids)} "
            f"generated, finish: {o.finish_reason})"
        )
        print(o.text)
        for step in _logprobs_json(o.logprobs, tokenizer) or []:
            top = ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in step["top_logprobs"])
            print(
                f"  {step['token']!r}: logprob {step['logprob']:.3f}"
                + (f" | top: {top}" if top else "")
            )
    dec, n_out, elapsed = (
        summary["decode_tokens_per_s"],
        summary["output_tokens"],
        summary["elapsed_s"],
    )
    threads = f", {summary['cpu_threads']} threads" if summary["cpu_threads"] else ""
    print(f"--- {summary['device']}, {summary['dtype']}{threads}")
    if dec is None:
        print(f"--- {n_out} tokens in {elapsed:.2f} s")
        return
    print(
        f"--- {n_out} tokens in {elapsed:.2f} s: {summary['output_tokens_per_s']:.1f} tok/s overall, "
        f"{dec:.1f} tok/s decode, TTFT {summary['mean_time_to_first_token_s'] * 1000:.0f} ms; "
        f"KV slots peak {stats['kv_slots_peak']} of {stats['kv_slots_total']} per layer"
    )
