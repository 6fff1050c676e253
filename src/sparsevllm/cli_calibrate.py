"""`sparsevllm calibrate`: a model's `bench quality` reports -> its calibration file,
which `kv_budget: "auto"` reads (docs/calibration.md). Torch-free."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from sparsevllm.bench.quality.calibrate import build_calibration, resolve_exclusions
from sparsevllm.bench.quality.reports import load_report
from sparsevllm.calibration import (
    DEFAULT_CALIBRATION_DIR,
    Calibration,
    calibration_file_name,
    write_calibration,
)
from sparsevllm.calibration.schema import dumps


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="Turn bench quality reports into a calibration file (for kv_budget auto).",
        description="Reads `sparsevllm bench quality --json` reports of one model and writes "
        "its calibration: per sparse method and measured length, the kept fraction of the "
        "prompt (1 - ratio) against the accuracy relative to vanilla's on the same samples. "
        'A request with kv_budget "auto" and min_accuracy gets the smallest budget whose '
        "calibrated accuracy meets the floor (docs/calibration.md). Prints a JSON summary. "
        "Example: sparsevllm calibrate out/q.json --out "
        "src/sparsevllm/calibration/data/my-model.json. `sparsevllm calibrate duoattention "
        "--help`: the head scores of the duoattention method instead.",
    )
    p.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT.json",
        help="Quality reports of one model (bench quality --json). Each method row is "
        "compared with vanilla's row on the same samples, from its own report or from "
        "another one given here measured the same way (task, length, samples, seed, dtype, "
        "chat); rows of the same method, length and ratio are pooled over tasks and reports.",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="Calibration file to write (default: the committed calibration directory, "
        f"{DEFAULT_CALIBRATION_DIR}, under the model's name).",
    )
    p.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help="Another name the model answers to, besides the reports' model file or "
        "directory name (repeatable), e.g. the name of the same weights in another format.",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="REPORT:METHOD",
        help="Leave METHOD's rows of one report out (REPORT: its path as given or its file "
        "name; repeatable), e.g. rows measured with a method default that has changed since.",
    )
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    reports = [load_report(path) for path in args.reports]
    exclude = resolve_exclusions(reports, args.exclude)
    cal = build_calibration(reports, _command(args), exclude, args.name)
    out = Path(args.out) if args.out else DEFAULT_CALIBRATION_DIR / calibration_file_name(cal.model)
    write_calibration(cal, out)
    print(dumps(_summary(cal, out)))
    return 0


def _command(args: argparse.Namespace) -> str:
    """The command as it can be run again (the flags in a fixed order)."""
    words = ["sparsevllm", "calibrate", *args.reports]
    for flag, values in (("--exclude", args.exclude), ("--name", args.name)):
        for value in values:
            words += [flag, value]
    if args.out:
        words += ["--out", args.out]
    return shlex.join(words)


def _summary(cal: Calibration, out: Path) -> dict[str, object]:
    methods = {
        name: [
            {
                "length": p.length,
                "kept_fraction": p.kept_fraction,
                "relative_accuracy": round(p.relative_accuracy, 4),
                "num_samples": p.num_samples,
            }
            for p in curve.points
        ]
        for name, curve in sorted(cal.methods.items())
    }
    return {"out": str(out), "model": list(cal.model.names), "methods": methods}
