"""The quality report: per-cell accuracy, run metadata, a markdown table and a plot.

Rows and summary entries carry their `mode`; the table has one block per mode and the
plot draws the query-agnostic lines dotted beside the query-aware ones."""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparsevllm.bench.quality.grid import (
    BUDGET_RULE,
    DEFAULT_MODES,
    QUERY_AGNOSTIC,
    QUERY_AWARE,
    Grid,
    Key,
    make_key,
)
from sparsevllm.bench.quality.settings import (
    ANSWER_SEP,
    ENGINE_DEFAULTS,
    QUERY_AGNOSTIC_ENGINE,
    RunSettings,
)
from sparsevllm.bench.quality.turns import ACK

# How the query-agnostic turns are built, as the report states it (see `turns`).
TWO_TURNS = {
    "turn_1": "the context without the question; max_tokens=1, the sampled token is dropped",
    "turn_2": "turn 1's token ids + the question + the answer prefix, continuing turn 1's "
    "cached state (chain cache for eviction methods, radix prefix cache for the others)",
    "chat_reply": ACK,
    "engine": QUERY_AGNOSTIC_ENGINE,
}


def aggregate(grid: Grid, records: dict[Key, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, method, ratio, task, length): mean score over the samples present."""
    rows = []
    for cell in grid.cells():
        for length in grid.lengths if cell.length is None else (cell.length,):
            for task in grid.tasks:
                keys = [
                    make_key(cell.method, cell.ratio, task, length, s, cell.mode)
                    for s in grid.seeds()
                ]
                recs = [records[k] for k in keys if k in records]
                n = len(recs)
                rows.append(
                    {
                        "mode": cell.mode,
                        "method": cell.method,
                        "ratio": cell.ratio,
                        "task": task,
                        "length": length,
                        "budget": cell.budget(length),
                        "num_samples": n,
                        "accuracy": sum(r["score"] for r in recs) / n if n else None,
                        "exact_match": sum(r["correct"] for r in recs) / n if n else None,
                        "mean_prompt_tokens": sum(r["num_tokens"] for r in recs) / n if n else None,
                    }
                )
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean accuracy of each (mode, method, ratio) over its tasks and lengths."""
    groups: dict[tuple[str, str, float], list[float]] = {}
    for row in rows:
        key = (row.get("mode", QUERY_AWARE), row["method"], row["ratio"])
        scores = groups.setdefault(key, [])
        if row["accuracy"] is not None:
            scores.append(row["accuracy"])
    return [
        {"mode": mode, "method": m, "ratio": r, "accuracy": sum(s) / len(s) if s else None}
        for (mode, m, r), s in groups.items()
    ]


def versions() -> dict[str, str | None]:
    """Versions of the software that produced the numbers."""
    import torch
    import transformers

    import sparsevllm

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(sparsevllm.__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "sparsevllm": sparsevllm.__version__,
        "git_commit": commit or None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def build_report(
    grid: Grid,
    settings: RunSettings,
    records: dict[Key, dict[str, Any]],
    timings: list[dict[str, Any]],
    started: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """The aggregate JSON: metadata, per-cell rows and the per-(method, ratio) summary."""

    rows = aggregate(grid, records)
    engine = {**ENGINE_DEFAULTS, **settings.engine}
    metadata = {
        "model": settings.model,
        "dtype": timings[0]["dtype"] if timings else engine.get("dtype", "auto"),
        "device": timings[0]["device"] if timings else engine.get("device", "auto"),
        "engine": engine,
        "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()},
        "chat": settings.chat,
        "modes": list(grid.modes),
        "two_turns": TWO_TURNS if QUERY_AGNOSTIC in grid.modes else None,
        "answer_sep": ANSWER_SEP,
        "max_tokens": settings.max_tokens or "per task",
        "decoding": "greedy",
        "budget_rule": BUDGET_RULE,
        "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": elapsed_s,
        "num_records": sum(r["num_samples"] for r in rows),
        "engines_run": timings,
        "versions": versions(),
    }
    return {"metadata": metadata, "results": rows, "summary": summarize(rows)}


def _pct(value: float | None) -> str:
    """Accuracy as a percentage with one decimal; `-` when missing."""
    return "-" if value is None else f"{100 * value:.1f}"


def report_modes(report: dict[str, Any]) -> list[str]:
    """The report's modes, in grid order (reports from before modes: query-aware only)."""
    return list(report["metadata"]["grid"].get("modes") or DEFAULT_MODES)


def markdown_table(report: dict[str, Any]) -> str:
    """Accuracy (%) per method and ratio (rows) and task, per length when there are several;
    one table per mode, each under its name when there are several."""
    modes = report_modes(report)
    if len(modes) == 1:
        return _mode_table(report, modes[0])
    return "\n\n".join(f"{mode}:\n\n{_mode_table(report, mode)}" for mode in modes)


def _mode_table(report: dict[str, Any], mode: str) -> str:
    grid = report["metadata"]["grid"]
    several = len(grid["lengths"]) > 1
    columns = [(t, n) for n in grid["lengths"] for t in grid["tasks"]]
    names = [f"{t} @{n}" if several else t for t, n in columns]
    acc = {
        (r["method"], r["ratio"], r["task"], r["length"]): r["accuracy"]
        for r in report["results"]
        if r.get("mode", QUERY_AWARE) == mode
    }
    lines = [
        "| method | ratio | " + " | ".join(names) + " | mean |",
        "|---|---:|" + "---:|" * (len(names) + 1),
    ]
    for s in report["summary"]:
        if s.get("mode", QUERY_AWARE) != mode:
            continue
        m, r = s["method"], s["ratio"]
        cells = [_pct(acc.get((m, r, t, n))) for t, n in columns]
        lines.append(f"| {m} | {r:g} | " + " | ".join(cells) + f" | {_pct(s['accuracy'])} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Accuracy vs compression ratio: one row of panels per mode (and length), one per
    task, one line per method (its colour and marker the same in every panel), vanilla as
    a horizontal reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = report["metadata"]["grid"]
    tasks, lengths, modes = grid["tasks"], grid["lengths"], report_modes(report)
    panels = [(mode, length) for mode in modes for length in lengths]
    fig, axes = plt.subplots(
        len(panels), len(tasks), figsize=(4.6 * len(tasks), 3.6 * len(panels)), squeeze=False
    )
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    for i, (mode, length) in enumerate(panels):
        for j, task in enumerate(tasks):
            rows = [
                r
                for r in report["results"]
                if r["task"] == task
                and r["length"] == length
                and r.get("mode", QUERY_AWARE) == mode
            ]
            _plot_panel(axes[i][j], rows, grid["ratios"], methods, mode)
            title = f"{task} ({length} tokens)"
            axes[i][j].set_title(title + (f", {mode.replace('_', '-')}" if len(modes) > 1 else ""))
    handles, labels = axes[0][0].get_legend_handles_labels()
    model = Path(str(report["metadata"]["model"])).name
    fig.suptitle(f"long-context quality vs KV compression: {model}")
    fig.tight_layout()
    # Beside the panels, one method per line: any number of methods fits without
    # covering the axis labels; bbox_inches="tight" widens the image to hold it.
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# Line styles per mode, as the panel titles also say; vanilla stays black.
_STYLE = {QUERY_AWARE: ("-", "--"), QUERY_AGNOSTIC: (":", "-.")}  # (methods, vanilla)
_MARKERS = "osD^vPX*<>ph"


def _plot_panel(
    ax: Any, rows: list[dict[str, Any]], ratios: Sequence[float], methods: list[str], mode: str
) -> None:
    """One task, length and mode: a line per sparse method, vanilla as a flat line. A
    method's colour (20 distinct ones) and marker follow its index in `methods`."""
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab20")
    line, flat = _STYLE[mode]
    for k, method in enumerate(methods):
        mine = [r for r in rows if r["method"] == method]
        points = sorted((r["ratio"], r["accuracy"]) for r in mine if r["accuracy"] is not None)
        if not points:
            continue
        if all(r["budget"] is None for r in mine):
            ax.axhline(points[0][1], color="black", linestyle=flat, label=method)
        else:
            xs, ys = zip(*points)
            style = {"color": palette(k % 20), "marker": _MARKERS[k % len(_MARKERS)]}
            ax.plot(xs, ys, linestyle=line, label=method, **style)
    # Vanilla (ratio 0) is the flat line: the axis spans the measured ratios only.
    ax.set_xlim(min(ratios) - 0.05, max(ratios) + 0.05)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xticks(sorted(ratios))
    ax.set_xlabel("compression ratio")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
