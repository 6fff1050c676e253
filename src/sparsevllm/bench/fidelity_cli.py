"""`sparsevllm bench fidelity`'s command line: flags, the printed table, the plot and
the JSON report. The measurement itself is bench/fidelity.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sparsevllm.bench.fidelity import (
    DEFAULT_DTYPE,
    DEFAULT_FORMATS,
    DEFAULT_KL_CHUNK,
    DEFAULT_KL_TOKENS,
    DEFAULT_NEW_TOKENS,
    DEFAULT_NUM_PROMPTS,
    DEFAULT_PROMPT_TOKENS,
    REFERENCE,
    pool_slots,
    resolve_model,
    run_fidelity,
)
from sparsevllm.config import FIELD_HELP, EngineConfig, check_keys
from sparsevllm.kv.names import FORMAT_NAMES, check_format_name

# Engine flags of this command: (field, type); every other field via --config.
ENGINE_FLAGS: list[tuple[str, type]] = [
    ("device", str),
    ("max_num_seqs", int),
    ("max_num_batched_tokens", int),
    ("chunk_prefill_size", int),
    ("max_model_len", int),
    ("num_kv_slots", int),
    ("enforce_eager", bool),
]
# Settings the command chooses itself; a config file may not set them.
_OWNED = ("model", "dtype", "kv_cache_dtype")


# ------------------------------------------------------------------------ output


def markdown_table(report: dict[str, Any]) -> str:
    """One row per format: agreement, KL and bytes per slot (auto's bytes first)."""
    s = report["settings"]
    n, new = s["num_prompts"], s["new_tokens"]
    lines = [
        f"| kv_cache_dtype | identical first {new} (of {n}) | mean common prefix (of {new}) "
        "| mean KL (nats) | max KL (nats) | argmax agreement | KV bytes/slot |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| {REFERENCE} (reference) | - | - | - | - | - | "
        f"{report['reference']['kv_bytes_per_slot']} |",
    ]
    for fmt, r in report["formats"].items():
        lines.append(
            f"| {fmt} | {r['identical_first_n']} | {r['mean_common_prefix']:.2f} | "
            f"{r['mean_kl']:.3g} | {r['max_kl']:.3g} | {r['argmax_agreement']:.4f} | "
            f"{r['kv_bytes_per_slot']} |"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Bar charts per format: prompts with identical tokens, mean common prefix, KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, rows = report["settings"], report["formats"]
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("identical_first_n", f"prompts with identical first {s['new_tokens']} tokens",
         s["num_prompts"]),
        ("mean_common_prefix", "mean common prefix (tokens)", s["new_tokens"]),
    ]  # fmt: skip
    for ax, (key, title, top) in zip(axes, panels):
        ax.bar(names, [rows[f][key] for f in names], color="tab:blue")
        ax.set_ylim(0, top)
        ax.set_title(title, fontsize=10)
    width = 0.4
    xs = range(len(names))
    axes[2].bar(
        [x - width / 2 for x in xs], [rows[f]["mean_kl"] for f in names], width, label="mean"
    )
    axes[2].bar([x + width / 2 for x in xs], [rows[f]["max_kl"] for f in names], width, label="max")
    axes[2].set_xticks(list(xs), names)
    if all(rows[f]["mean_kl"] > 0 for f in names):
        axes[2].set_yscale("log")  # the mean is often 100x below the max
    axes[2].set_title(f"KL(auto || format), nats, {s['kl_positions']} positions", fontsize=10)
    axes[2].legend()
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"KV storage fidelity vs auto: {report['model_name']} ({report['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------ command line


def _formats(text: str) -> list[str]:
    """An argparse type: comma-separated kv_cache_dtype names, each checked."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no formats given")
    for name in names:
        try:
            check_format_name(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bench fidelity` under the `bench` subcommands."""
    p = sub.add_parser(
        "fidelity",
        help="KV storage formats (kv_cache_dtype) vs auto: greedy agreement and KL divergence.",
        description="Runs the same work with kv_cache_dtype=auto (the reference) and with each "
        "format: greedy completions of essay prompts (how many match auto's tokens, and the "
        "mean common prefix) and teacher-forced next-token distributions over one long text "
        "(mean and max KL(auto || format)). Example: sparsevllm bench fidelity --model "
        "gemma3-270m --json out/fidelity.json --plot out/fidelity.png",
    )
    w = p.add_argument_group("work")
    w.add_argument(
        "--model",
        default=None,
        help="Model path, or a bundled model: smollm2-135m (SmolLM2-135M-Instruct GGUF) or "
        "gemma3-270m (Gemma-3-270M GGUF) (default: smollm2-135m, the engine's default).",
    )
    w.add_argument(
        "--formats",
        type=_formats,
        default=list(DEFAULT_FORMATS),
        help=f"Comma-separated kv_cache_dtype formats to compare with auto, which always runs "
        f"as the reference; naming auto again checks that reruns agree "
        f"(default: {','.join(DEFAULT_FORMATS)}; available: {', '.join(FORMAT_NAMES)}).",
    )
    w.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=["auto", "float32", "float16", "bfloat16"],
        help=f"Compute dtype, also auto's KV dtype (default: {DEFAULT_DTYPE}).",
    )
    _add_int(w, "--num-prompts", DEFAULT_NUM_PROMPTS, "Greedy-agreement prompts")
    _add_int(w, "--prompt-tokens", DEFAULT_PROMPT_TOKENS, "Tokens per agreement prompt (+-2%%)")
    _add_int(w, "--new-tokens", DEFAULT_NEW_TOKENS, "Greedy tokens generated per prompt")
    _add_int(w, "--kl-tokens", DEFAULT_KL_TOKENS, "Tokens of the teacher-forced KL text")
    _add_int(
        w,
        "--kl-chunk",
        DEFAULT_KL_CHUNK,
        "Prefill chunk of the KL text: a chunk's queries read its own K/V as computed and "
        "everything older from storage, so small chunks measure what decode steps see",
    )
    w.add_argument("--seed", type=int, default=0, help="Seed of the texts (default: 0).")
    w.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Send the agreement prompts through the chat template (default: when the "
        "tokenizer has one).",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", help="Write the report as JSON here.")
    o.add_argument("--plot", metavar="PNG", help="Save bar charts of agreement and KL here.")
    o.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    _add_engine_flags(p)
    p.set_defaults(func=run_cli)


def _add_int(group: argparse._ArgumentGroup, flag: str, default: int, text: str) -> None:
    group.add_argument(flag, type=int, default=default, help=f"{text} (default: {default}).")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--config and the engine flags that matter here, with EngineConfig's help text."""
    e = p.add_argument_group("engine")
    e.add_argument(
        "--config",
        metavar="FILE",
        help="JSON file of engine settings shared by every engine (not model, dtype or "
        "kv_cache_dtype); flags override it.",
    )
    defaults = EngineConfig.knob_defaults()
    for name, kind in ENGINE_FLAGS:
        flag = "--" + name.replace("_", "-")
        shown = "unset" if defaults[name] is None else defaults[name]
        if name == "num_kv_slots":
            shown = "sized to the work, the same for every format"
        text = f"{FIELD_HELP[name]} (default: {shown})".replace("%", "%%")
        if kind is bool:
            action: Any = argparse.BooleanOptionalAction
            e.add_argument(flag, action=action, default=argparse.SUPPRESS, help=text)
        else:
            e.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings shared by every format: --config, the flags (which win), the
    dtype, no prefix caching and a pool sized to the work unless the user sized it."""
    settings: dict[str, Any] = {}
    if args.config:
        settings = json.loads(Path(args.config).read_text())
        if not isinstance(settings, dict):
            raise ValueError(f"config file {args.config} must hold a JSON object")
        check_keys(settings, EngineConfig.option_names(), what="config key")
        owned = [k for k in _OWNED if k in settings]
        if owned:
            raise ValueError(f"the config file sets {', '.join(owned)}; use the flags instead")
    settings.update({name: getattr(args, name) for name, _ in ENGINE_FLAGS if name in args})
    settings["dtype"] = args.dtype
    settings.setdefault("enable_prefix_caching", False)  # every prompt is computed
    if "num_kv_slots" not in settings and "kv_cache_memory_gb" not in settings:
        # One pool size for all formats: a fixed byte budget would give the smaller
        # formats more slots, and a different schedule would blur the comparison.
        settings["num_kv_slots"] = pool_slots(
            args.num_prompts, args.prompt_tokens, args.new_tokens, args.kl_tokens
        )
    return settings


def check_args(args: argparse.Namespace) -> None:
    """Reject bad values before any model is loaded (`main` turns a ValueError into one
    error line and exit status 2; bench/ sits below cli_errors in the layers)."""
    for name in ("num_prompts", "prompt_tokens", "new_tokens", "kl_chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kl_tokens < 2:
        raise ValueError(f"--kl-tokens must be >= 2, got {args.kl_tokens}")


def run_cli(args: argparse.Namespace) -> int:
    """Run, print the table, write the JSON (and the plot)."""
    check_args(args)
    engine = engine_settings(args)
    EngineConfig.from_dict({**engine, "kv_cache_dtype": REFERENCE})  # bad settings fail now
    model = resolve_model(args.model)
    settings = {
        "num_prompts": args.num_prompts,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "kl_tokens": args.kl_tokens,
        "kl_chunk": args.kl_chunk,
        "seed": args.seed,
        "chat": args.chat,
    }
    report = run_fidelity(model, args.formats, engine, settings, not args.no_progress)
    print(markdown_table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(report, args.plot)
    print(f"{report['model_name']}: {report['elapsed_s']:.1f} s")
    return 0
