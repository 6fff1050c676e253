"""Collect `bench throughput` JSON reports of a context sweep into one table and plot.

    python -m sparsevllm.bench.sweep REPORT.json ... --json sweep.json --plot sweep.png

Each report is one (method, context) point; the plot draws decode throughput against
context length, one line per method, with each point's batch size in the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_FIELDS = (
    "sparse_method",
    "prompt_len",
    "batch_size",
    "decode_tokens_per_s",
    "time_per_output_token_s",
    "prefill_tokens_per_s",
    "roofline_fraction",
    "peak_kv_bytes",
    "knobs",
)


def collect(paths: list[str]) -> list[dict[str, Any]]:
    """One row per report, sorted by method then context."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for report in data if isinstance(data, list) else [data]:  # sweeps write lists
            rows.append({k: report.get(k) for k in _FIELDS} | {"file": Path(path).name})
    return sorted(
        rows, key=lambda r: (r["sparse_method"] != "vanilla", r["sparse_method"], r["prompt_len"])
    )


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["sparse_method"] for r in rows):
        pts = [r for r in rows if r["sparse_method"] == method and r["decode_tokens_per_s"]]
        style = "-" if method == "vanilla" else "--"
        ax.plot(
            [r["prompt_len"] for r in pts],
            [r["decode_tokens_per_s"] for r in pts],
            style,
            marker="o",
            label=method,
        )
    ax.set_xscale("log", base=2)
    values = [r["decode_tokens_per_s"] for r in rows if r["decode_tokens_per_s"]]
    if values and max(values) > 20 * min(values):  # a log axis only where linear hides
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode throughput (tokens/s, all sequences)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="bench throughput --json outputs")
    p.add_argument("--json", metavar="FILE", help="Write the collected rows as JSON.")
    p.add_argument("--plot", metavar="PNG", help="Save the throughput-vs-context plot.")
    p.add_argument("--title", default="decode throughput vs context", help="Plot title.")
    args = p.parse_args(argv)
    rows = collect(args.reports)
    for r in rows:
        tps = r["decode_tokens_per_s"]
        print(
            f"{r['sparse_method']:12s} ctx {r['prompt_len']:7d}  batch {r['batch_size']:3d}  "
            f"decode {tps if tps is None else round(tps, 1)} tok/s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
