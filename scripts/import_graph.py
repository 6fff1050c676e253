"""Draw the package's layers from its real imports: `docs/architecture_layers.png`.

The layers are the ones `lint-imports` enforces (pyproject.toml); the arrows are every
import between top-level packages that grimp finds in the source (function-level ones
included), drawn downward. Usage: PYTHONPATH=src python scripts/import_graph.py [OUT.png]
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import grimp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [[m.strip() for m in row.replace(":", "|").split("|")] for row in contract["layers"]]


def package_edges(names: list[str]) -> dict[tuple[str, str], int]:
    graph = grimp.build_graph("sparsevllm", exclude_type_checking_imports=True)

    def owner(module: str) -> str | None:
        return next((n for n in names if module == n or module.startswith(n + ".")), None)

    edges: dict[tuple[str, str], int] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = owner(module), owner(imported)
            if a and b and a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    return edges


def draw(out: Path) -> None:
    rows = layers()
    pos = {}
    for y, row in enumerate(rows):
        for x, name in enumerate(row):
            # Single boxes zigzag so that arrows past a layer miss the boxes between.
            zig = 0.0 if len(row) > 1 else (0.12 if y % 2 else -0.12)
            pos[name] = ((x + 1) / (len(row) + 1) + zig, 1 - y / (len(rows) - 1))
    edges = package_edges([n for row in rows for n in row])
    fig, ax = plt.subplots(figsize=(9, 11))
    for (a, b), count in edges.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        skip = abs(y0 - y1) > 1.5 / (len(rows) - 1)  # past a layer: lighter
        ax.annotate(
            "",
            xy=(x1, y1 + 0.012),
            xytext=(x0, y0 - 0.012),
            arrowprops={
                "arrowstyle": "->",
                "color": "0.45" if not skip else "0.7",
                "lw": 0.6 + 0.15 * min(count, 10),
            },
        )
    for name, (x, y) in pos.items():
        ax.text(
            x,
            y,
            name.removeprefix("sparsevllm."),
            ha="center",
            va="center",
            fontsize=10,
            bbox={"boxstyle": "round", "fc": "#e8f0fe", "ec": "#4a6fa5"},
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.05, 1.05)
    ax.axis("off")
    ax.set_title("sparsevllm layers (lint-imports contract); arrows: imports found in the code")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{len(edges)} package-level import edges -> {out}")


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture_layers.png")
