"""One table and one plot from `bench quality` reports of the same grid in several KV
storage formats (scripts/gpu_suite.sh quality-formats writes one report per format).

    python scripts/quality_formats_table.py docs/quality/quality_gemma3_270m_4k_kv_*.json \
        --plot docs/quality/quality_gemma3_270m_4k_kv_formats.png
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sparsevllm.bench.quality.reports import load_report  # noqa: E402

ORDER = ["auto", "bfloat16", "float16", "fp8_e4m3", "int8", "int4", "int2"]


def collect(paths: list[str]) -> dict[str, dict[tuple[str, str], float]]:
    """format -> (method, task) -> accuracy in %."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for path in paths:
        report = load_report(path)
        fmt = report.metadata["engine"].get("kv_cache_dtype", "auto")
        out[fmt] = {(r.method, r.task): 100 * r.accuracy for r in report.rows}
    return dict(sorted(out.items(), key=lambda kv: ORDER.index(kv[0])))


def table(acc: dict[str, dict[tuple[str, str], float]]) -> str:
    keys = sorted({k for rows in acc.values() for k in rows})
    head = "| kv_cache_dtype | " + " | ".join(f"{m} {t}" for m, t in keys) + " |"
    lines = [head, "|---|" + "---:|" * len(keys)]
    for fmt, rows in acc.items():
        cells = " | ".join(f"{rows[k]:.0f}" if k in rows else "-" for k in keys)
        lines.append(f"| {fmt} | {cells} |")
    return "\n".join(lines)


def plot(acc: dict[str, dict[tuple[str, str], float]], path: str) -> None:
    keys = sorted({k for rows in acc.values() for k in rows})
    tasks = sorted({t for _, t in keys})
    methods = sorted({m for m, _ in keys}, key=lambda m: (m != "vanilla", m))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    width = 0.8 / len(methods)
    for ax, task in zip(axes[0], tasks):
        for j, method in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(acc))]
            ys = [rows.get((method, task), 0.0) for rows in acc.values()]
            ax.bar(xs, ys, width, label=method)
        ax.set_xticks(range(len(acc)), list(acc))
        ax.set_ylim(0, 100)
        ax.set_ylabel("accuracy (%)")
        ax.set_title(task)
        ax.legend()
    fig.suptitle("Gemma-3-270M, 4K, 20 samples: accuracy by KV storage format")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="bench quality --json reports, one per format")
    p.add_argument("--plot", metavar="PNG", help="Save a bar chart here.")
    args = p.parse_args()
    acc = collect(args.reports)
    print(table(acc))
    if args.plot:
        plot(acc, args.plot)


if __name__ == "__main__":
    main()
