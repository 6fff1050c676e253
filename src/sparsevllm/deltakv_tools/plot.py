"""The loss curve of a training run as a PNG (matplotlib's Agg backend: no display)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)


def plot_losses(
    path: Path,
    train: Sequence[Mapping[str, float]],
    val: Sequence[Mapping[str, float]],
    title: str,
) -> None:
    """Training loss (per logged step) and validation loss with its K, V and attention
    parts, against the step, on a log scale."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot([p["step"] for p in train], [p["loss"] for p in train], lw=1, label="train")
    steps = [p["step"] for p in val]
    for key, style in (("loss", "-o"), ("k", "--"), ("v", "--"), ("attn", ":")):
        if val and key in val[0]:
            name = "validation" if key == "loss" else f"validation {key}"
            ax.plot(steps, [p[key] for p in val], style, ms=3, lw=1.2, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("relative squared error (mean over layers)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
