"""`sparsevllm deltakv collect | train | eval`: the DeltaKV compressor tool chain.

The parsers are torch-free (`--help` and usage errors stay fast); each command imports
its module (`sparsevllm.deltakv_tools`) when it runs. docs/methods.md ("DeltaKV") gives
the definition, docs/deltakv/ the commands that made the committed compressors.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

_EXAMPLE = (
    "Example: sparsevllm deltakv collect --out data/smol --prompts prompts.txt "
    "--haystacks niah_single,variable_tracking; sparsevllm deltakv train --data data/smol "
    "--out ckpt/smol; sparsevllm deltakv eval ckpt/smol/compressor.safetensors --data data/smol"
)


def add_deltakv_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "deltakv",
        help="DeltaKV compressors: collect K/V, train, evaluate.",
        description="Make a DeltaKV compressor for a model: collect its keys, values and "
        "queries from real engine runs, train the per-layer down/up maps, and measure their "
        "reconstruction and attention-output errors (docs/methods.md, DeltaKV). " + _EXAMPLE,
    )
    kinds = p.add_subparsers(dest="deltakv", required=True)
    _add_collect(kinds)
    _add_train(kinds)
    _add_eval(kinds)


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _add_collect(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = kinds.add_parser(
        "collect",
        help="Run the engine on text and save K, V and queries per layer.",
        description="Runs the model (dense attention) on token sequences and saves, per "
        "sequence and managed layer, the pre-RoPE keys and the values of every token and the "
        "post-RoPE queries of its last --queries positions, as sharded safetensors files "
        "with a manifest.json, stopping before the files would pass --max-gb. Sources "
        "(any mix, at least one): --prompts (the model's own generations), --haystacks "
        "(the quality suite's synthetic long prompts), --files (your text). Prints the "
        "manifest's summary as JSON.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="Directory to write (created).")
    p.add_argument(
        "--model",
        metavar="PATH",
        help="Model directory, .gguf file or config.json (default: the bundled default model).",
    )
    _collect_sources(p.add_argument_group("sources"))
    _collect_storage(p.add_argument_group("what is kept"))
    _collect_engine(p.add_argument_group("engine"))
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bars (stderr).")
    p.set_defaults(func=_lazy("sparsevllm.deltakv_tools.collect"))


def _collect_sources(src: argparse._ArgumentGroup) -> None:
    src.add_argument(
        "--prompts",
        metavar="FILE",
        help="Prompts whose continuations the model generates (.txt: one per line; .jsonl: "
        '{"prompt": ...} or {"messages": [...]} per line); each sequence is prompt + output.',
    )
    src.add_argument(
        "--chat", action="store_true", help="Wrap .txt prompts in the chat template (user turn)."
    )
    src.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="Tokens generated per prompt (default: 256; prompts are cut from the left to fit "
        "--max-tokens).",
    )
    src.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="Sampling temperature of the generations; 0 is greedy (default: 0.7).",
    )
    src.add_argument(
        "--haystacks",
        default="",
        metavar="TASKS",
        help="Comma-separated quality-suite tasks (e.g. niah_single,variable_tracking) whose "
        "prompts are captured, used in turn (default: none).",
    )
    src.add_argument(
        "--haystack-length",
        type=int,
        default=2048,
        help="Target length of a haystack prompt in tokens (default: 2048).",
    )
    src.add_argument(
        "--haystack-samples",
        type=int,
        default=8,
        help="Number of haystack prompts, seeds from --seed (default: 8).",
    )
    src.add_argument(
        "--files",
        nargs="+",
        default=[],
        metavar="FILE",
        help="Text files, each cut into windows of --max-tokens tokens (default: none).",
    )


def _collect_storage(cap: argparse._ArgumentGroup) -> None:
    cap.add_argument(
        "--max-tokens",
        type=int,
        default=2048,
        help="Longest sequence captured, in tokens (default: 2048).",
    )
    cap.add_argument(
        "--min-tokens",
        type=int,
        default=64,
        help="Shorter sequences are skipped (default: 64).",
    )
    cap.add_argument(
        "--queries",
        type=int,
        default=64,
        help="Queries kept per sequence and layer: those of its last positions, for the "
        "attention-output loss (default: 64).",
    )
    cap.add_argument(
        "--max-gb",
        type=_positive_float,
        default=1.0,
        help="Size cap of the written files in GiB; collection stops before passing it "
        "(default: 1).",
    )
    cap.add_argument(
        "--shard-mb",
        type=_positive_float,
        default=256.0,
        help="Target size of one shard file in MiB (default: 256).",
    )
    cap.add_argument(
        "--dtype",
        default="float16",
        choices=("float16", "bfloat16", "float32"),
        help="Storage dtype of K, V and queries (default: float16).",
    )


def _collect_engine(eng: argparse._ArgumentGroup) -> None:
    eng.add_argument(
        "--model-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="Dtype the model computes in (default: auto, the engine's choice).",
    )
    eng.add_argument("--device", default="auto", help="Device: auto, cpu, cuda (default: auto).")
    eng.add_argument(
        "--cpu-threads", type=int, help="Threads of a CPU engine (default: the engine's choice)."
    )
    eng.add_argument(
        "--seed", type=int, default=0, help="Seed of sampling and haystacks (default: 0)."
    )


def _add_train(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = kinds.add_parser(
        "train",
        help="Train a compressor on collected data.",
        description="Fits the per-layer down/up maps of a DeltaKV compressor to a capture "
        "(`deltakv collect --out`): relative K and V reconstruction errors of the compressed "
        "tokens plus the relative error of the captured queries' attention output over the "
        "reconstructed K/V, averaged over layers (AdamW, warmup then cosine). Held-out "
        "sequences validate. Writes compressor.safetensors, train_state.pt (for --resume), "
        "log.json and loss.png in --out; prints a JSON summary.",
    )
    p.add_argument("--data", required=True, metavar="DIR", help="A capture directory.")
    p.add_argument("--out", required=True, metavar="DIR", help="Output directory (created).")
    _train_shape(p.add_argument_group("compressor (recorded in the checkpoint)"))
    _train_optimisation(p.add_argument_group("optimisation"))
    _train_run(p.add_argument_group("run"))
    p.add_argument("--no-progress", action="store_true", help="Hide the progress bar (stderr).")
    p.set_defaults(func=_lazy("sparsevllm.deltakv_tools.train"))


def _train_shape(shape: argparse._ArgumentGroup) -> None:
    shape.add_argument(
        "--latent-dim",
        type=_int_list,
        default=[],
        metavar="R[,R...]",
        help="Latent width: one for every layer or one per compressed layer (default: "
        "kv_dim / 4, kv_dim = 2 x KV heads x head dim).",
    )
    shape.add_argument(
        "--hidden-dim",
        type=int,
        default=0,
        help="0: linear maps; N: GELU MLP maps with N hidden units (default: 0).",
    )
    shape.add_argument(
        "--cluster-ratio",
        type=float,
        default=0.1,
        help="Fraction of tokens kept as full-precision centers: every 1/ratio-th (default: 0.1).",
    )
    shape.add_argument(
        "--sink", type=int, default=4, help="Sink tokens, always full precision (default: 4)."
    )
    shape.add_argument(
        "--references",
        type=int,
        default=4,
        help="Nearest preceding centers a residual is taken against, at most --sink + 1 "
        "(default: 4).",
    )


def _train_optimisation(opt: argparse._ArgumentGroup) -> None:
    opt.add_argument("--steps", type=int, default=1000, help="Optimizer steps (default: 1000).")
    opt.add_argument("--lr", type=float, default=1e-3, help="Peak learning rate (default: 1e-3).")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW decay (default: 0).")
    opt.add_argument(
        "--k-weight", type=float, default=1.0, help="Weight of the K error (default: 1)."
    )
    opt.add_argument(
        "--v-weight", type=float, default=1.0, help="Weight of the V error (default: 1)."
    )
    opt.add_argument(
        "--attn-weight",
        type=float,
        default=1.0,
        help="Weight of the attention-output error (default: 1).",
    )
    opt.add_argument(
        "--init",
        default="pca",
        choices=("pca", "random"),
        help="pca: start linear maps from the residuals' weighted PCA; random: torch's "
        "default initialisation (default: pca).",
    )
    opt.add_argument("--seed", type=int, default=0, help="Seed of init and sampling (default: 0).")


def _train_run(run: argparse._ArgumentGroup) -> None:
    run.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="Fraction of sequences held out (by a hash of their key; default: 0.1).",
    )
    run.add_argument(
        "--eval-every", type=int, default=100, help="Validate every N steps (default: 100)."
    )
    run.add_argument(
        "--save-every", type=int, default=100, help="Save every N steps (default: 100)."
    )
    run.add_argument("--log-every", type=int, default=10, help="Log every N steps (default: 10).")
    run.add_argument("--device", default="cpu", help="Torch device: cpu, cuda, ... (default: cpu).")
    run.add_argument("--threads", type=int, help="CPU threads of torch (default: torch's choice).")
    run.add_argument(
        "--save-dtype",
        default="float32",
        choices=("float32", "float16", "bfloat16"),
        help="Dtype of the weights in compressor.safetensors (default: float32; training "
        "state stays float32).",
    )
    run.add_argument(
        "--resume", action="store_true", help="Continue the run saved in --out (same settings)."
    )
    run.add_argument("--stop-after", type=int, help="Stop after N steps of this run (resumable).")
    run.add_argument(
        "--time-limit", type=float, metavar="MIN", help="Stop after MIN minutes (resumable)."
    )


def _add_eval(kinds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = kinds.add_parser(
        "eval",
        help="Per-layer errors of a compressor on collected data.",
        description="Relative K, V and attention-output errors per layer of a checkpoint on "
        "a capture of the same model: with float latents, with INT4 latents, and of the "
        "references alone. Prints a table (percent); --json writes the report.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="A compressor .safetensors file.")
    p.add_argument("--data", required=True, metavar="DIR", help="A capture directory.")
    p.add_argument(
        "--split",
        default="val",
        choices=("val", "all"),
        help="val: the sequences training held out; all: every sequence (default: val).",
    )
    p.add_argument(
        "--int4-group",
        type=int,
        default=0,
        help="Channels per INT4 group of a latent; 0: the whole latent (default: 0).",
    )
    p.add_argument("--device", default="cpu", help="Torch device (default: cpu).")
    p.add_argument("--json", metavar="FILE", help="Also write the report as JSON.")
    p.set_defaults(func=_lazy("sparsevllm.deltakv_tools.evaluate"))


def _lazy(module: str) -> Callable[[argparse.Namespace], int]:
    """A command that imports its module (and torch) only when it runs."""

    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module).run_cli(args))

    return run
