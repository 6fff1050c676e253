"""`sparsevllm bench multiturn`: agent-style conversations with growing histories.

N conversations run concurrently for T turns. Each turn appends a tool output of L
tokens and a short question to the history and asks for a short answer; the next
turn resends the whole history. Variants: vanilla without cross-request state, vanilla
with the radix prefix cache, and each eviction method with the chain cache. Reports
end-to-end time, prefill tokens computed, cache-hit tokens and peak KV.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from tqdm.auto import tqdm

from sparsevllm.bench.model_configs import MODEL_CONFIGS, write_model_config
from sparsevllm.llm import LLM
from sparsevllm.sampling import SamplingParams

DEFAULT_VARIANTS = [
    "vanilla:nocache",
    "vanilla:radix",
    "streamingllm:chain",
    "snapkv:chain",
    "pyramidkv:chain",
    "h2o:chain",
    "tova:chain",
    "knorm:chain",
]


def make_turn_inputs(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """[conversation][turn] -> tokens appended that turn (tool output + question)."""
    rng = random.Random(args.seed)
    low = min(1000, vocab // 4)  # stay clear of special tokens at the start of the vocab
    return [
        [
            [rng.randrange(low, vocab) for _ in range(args.tool_tokens + args.question_tokens)]
            for _ in range(args.turns)
        ]
        for _ in range(args.conversations)
    ]


def run_variant(
    variant: str, model: str, engine_kwargs: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    method, cache = variant.split(":")
    kwargs = dict(engine_kwargs, sparse_method=method, enable_prefix_caching=cache != "nocache")
    llm = LLM(model, **kwargs)
    engine = llm.engine
    inputs = make_turn_inputs(args, engine.source.hf_config.vocab_size)
    histories = [[1] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttft: list[float] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + inp[turn] for h, inp in zip(histories, inputs)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        ttft += [o.metrics["time_to_first_token"] for o in outs]
        histories = [p + o.token_ids for p, o in zip(prompts, outs)]
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    result = {
        "variant": variant,
        "sparse_method": method,
        "cache": cache,
        "knobs": engine.method.knob_values(),
        "end_to_end_s": elapsed,
        "prefill_tokens_computed": stats["num_prefill_tokens_computed"],
        "cache_hit_tokens": stats["num_cached_prompt_tokens"],
        "peak_kv_slots": stats["kv_slots_peak"],
        "peak_kv_bytes": stats["kv_slots_peak"] * engine.runner.kv_bytes_per_slot,
        "num_preemptions": stats["num_preemptions"],
        "mean_time_to_first_token_s": sum(ttft) / len(ttft),
        "final_history_tokens": sum(len(h) for h in histories) / len(histories),
    }
    llm.close()  # the next variant's engine needs the device memory
    return result


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(
        axes,
        ["end_to_end_s", "prefill_tokens_computed", "peak_kv_slots"],
        ["end-to-end time (s)", "prefill tokens computed", "peak KV slots per layer"],
    ):
        ax.barh(names, [r[key] for r in results], color="tab:blue")
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle("multi-turn agent benchmark")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parser(sub: argparse._SubParsersAction, add_engine_args: Any) -> None:
    p = sub.add_parser(
        "multiturn",
        help="Multi-turn agent conversations: vanilla vs radix cache vs chain cache.",
        description="N concurrent conversations x T turns; each turn appends a tool output of "
        "L tokens and a question, and the whole history is sent again. Compares vanilla without "
        "cache, vanilla with the radix cache and eviction methods with the chain cache.",
    )
    p.add_argument(
        "--model-config",
        choices=sorted(MODEL_CONFIGS),
        help="A named real-shape config with dummy weights.",
    )
    p.add_argument(
        "--conversations", type=int, default=4, help="Concurrent conversations (default: 4)."
    )
    p.add_argument("--turns", type=int, default=4, help="Turns per conversation (default: 4).")
    p.add_argument(
        "--tool-tokens",
        type=int,
        default=256,
        help="Tool-output tokens appended per turn (default: 256).",
    )
    p.add_argument(
        "--question-tokens", type=int, default=16, help="Question tokens per turn (default: 16)."
    )
    p.add_argument(
        "--output-len", type=int, default=32, help="Answer tokens per turn (default: 32)."
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=DEFAULT_VARIANTS,
        help="method:cache pairs, cache one of nocache, radix, chain (default: %(default)s).",
    )
    p.add_argument(
        "--bench-seed",
        dest="seed",
        type=int,
        default=0,
        help="Seed of the synthetic conversations.",
    )
    p.add_argument("--json", metavar="FILE", help="Write the report as JSON.")
    p.add_argument("--plot", metavar="PNG", help="Save a bar chart.")
    add_engine_args(p)
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from sparsevllm.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    kwargs = {k: v for k, v in config.to_dict().items() if k in vars(args)}
    kwargs.pop("sparse_method", None)
    kwargs.pop("enable_prefix_caching", None)
    model = kwargs.pop("model", None)
    if args.model_config:
        model = write_model_config(args.model_config)
        kwargs.setdefault("load_format", "dummy")
    results = [run_variant(v, model, kwargs, args) for v in tqdm(args.variants, desc="variants")]
    base = next((r for r in results if r["variant"] == "vanilla:nocache"), None)
    for r in results:
        if base is not None:
            r["speedup_vs_vanilla_nocache"] = base["end_to_end_s"] / r["end_to_end_s"]
    report = {
        "model": args.model_config or model or "default",
        "conversations": args.conversations,
        "turns": args.turns,
        "tool_tokens": args.tool_tokens,
        "question_tokens": args.question_tokens,
        "output_len": args.output_len,
        "engine": kwargs,
        "results": results,
    }
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        plot(results, args.plot)
    print(text)
    for r in results:
        print(
            f"{r['variant']:22s} {r['end_to_end_s']:8.2f} s  prefill {r['prefill_tokens_computed']:8d}  "
            f"hits {r['cache_hit_tokens']:8d}  peak KV {r['peak_kv_slots']:7d}"
        )
    return 0
