"""A training run's resumable state: `train_state.pt` beside the compressor it trains.

It holds what a run needs to continue bit for bit where it stopped: the float32 weights
(the compressor file may be saved in a lower precision), the optimizer's moments, the
sampler's RNG state, the step, the log so far, and the settings and data identity that
must not change across a resume (a resume under other settings would be another run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

STATE_FILE = "train_state.pt"
# Settings a resume may change: how long this run goes on, where it runs, how it reports
# and saves; none of them changes the optimisation.
FREE_SETTINGS = frozenset(
    {
        "stop_after",
        "time_limit_min",
        "progress",
        "data",
        "out",
        "threads",
        "device",
        "save_dtype",
        "eval_every",
        "save_every",
        "log_every",
    }
)

Entry = dict[str, float]


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list[Entry] = field(default_factory=list)  # training losses by step
    validation: list[Entry] = field(default_factory=list)  # validation losses by step


def save_state(
    out: Path,
    state: TrainState,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, object],
    generator: torch.Tensor,
    fixed: dict[str, object],
) -> None:
    """Write the state atomically (a crash mid-write leaves the previous one)."""
    blob = {
        "step": state.step,
        "seconds": state.seconds,
        "history": state.history,
        "validation": state.validation,
        "weights": {k: v.detach().cpu().float().clone() for k, v in weights.items()},
        "optimizer": optimizer,
        "generator": generator,
        "fixed": fixed,
    }
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(blob, tmp)
    tmp.replace(out / STATE_FILE)


@dataclass
class LoadedState:
    state: TrainState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, object]
    generator: torch.Tensor


def load_state(out: Path, fixed: dict[str, object]) -> LoadedState:
    """The state in `out`; refuses one made under other fixed settings (naming them)."""
    path = out / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no {STATE_FILE} in {out}")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    before = blob["fixed"]
    changed = sorted(k for k in set(before) | set(fixed) if before.get(k) != fixed.get(k))
    if changed:
        detail = "; ".join(f"{k}: {before.get(k)!r} -> {fixed.get(k)!r}" for k in changed)
        raise ValueError(f"--resume: {path} was trained under other settings ({detail})")
    state = TrainState(blob["step"], blob["seconds"], blob["history"], blob["validation"])
    return LoadedState(state, blob["weights"], blob["optimizer"], blob["generator"])
