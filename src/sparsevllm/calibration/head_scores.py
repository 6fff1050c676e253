"""DuoAttention's head-score files: one small JSON file per model, written by
`sparsevllm calibrate duoattention` and read by the `duoattention` sparse method.

A file holds, for every layer of the model, one score per KV head (higher: the head is
more of a retrieval head; null for a layer the method does not manage, e.g. Gemma 3's
sliding-window layers), the model's identity (names and config fingerprint, matched as
calibrations are, see identity.py), how the scores were made and when:

    {"format": "sparsevllm-duoattention-head-scores", "version": 1,
     "model": {"names": ["SmolLM2-135M-Instruct.Q4_1.gguf"], "fingerprint": "sha256:..."},
     "num_layers": 30, "num_kv_heads": 3,
     "scores": [[0.12, 1.0, 0.03], ...],
     "scoring": "...", "settings": {...}, "date": "2026-...", "command": "sparsevllm ..."}

The shipped files live in `data/duoattention/` (beside, not inside, the budget
calibrations: that directory's files are all budget calibrations). Torch-free.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparsevllm.calibration.identity import DEFAULT_CALIBRATION_DIR, calibration_file_name
from sparsevllm.calibration.schema import ModelIdentity, dumps

FORMAT = "sparsevllm-duoattention-head-scores"
VERSION = 1
DEFAULT_HEAD_SCORES_DIR = DEFAULT_CALIBRATION_DIR / "duoattention"
MAKE_ONE = "sparsevllm calibrate duoattention --model MODEL"


@dataclass(frozen=True)
class HeadScores:
    """Per-layer, per-KV-head scores of one model (None: a layer without scores)."""

    model: ModelIdentity
    num_layers: int
    num_kv_heads: int
    scores: tuple[tuple[float, ...] | None, ...]
    scoring: str = ""
    settings: Mapping[str, object] = field(default_factory=dict)
    date: str = ""
    command: str = ""
    path: str | None = None  # where it was read from (for messages)

    def __post_init__(self) -> None:
        where = self.path or "head scores"
        if len(self.scores) != self.num_layers:
            raise ValueError(
                f"{where}: 'scores' has {len(self.scores)} layers, num_layers says "
                f"{self.num_layers}"
            )
        for layer, row in enumerate(self.scores):
            if row is None:
                continue
            if len(row) != self.num_kv_heads:
                raise ValueError(
                    f"{where}: layer {layer} has {len(row)} scores, num_kv_heads says "
                    f"{self.num_kv_heads}"
                )
            if not all(isinstance(s, (int, float)) and math.isfinite(s) for s in row):
                raise ValueError(f"{where}: layer {layer} has a score that is not a number")

    def check_shape(self, num_layers: int, num_kv_heads: int, layers: Sequence[int]) -> None:
        """ValueError unless the file fits a model of this shape whose managed layers are
        `layers` (each of them must have scores)."""
        where = self.path or "the head scores"
        if (self.num_layers, self.num_kv_heads) != (num_layers, num_kv_heads):
            raise ValueError(
                f"{where} were made for {self.num_layers} layers x {self.num_kv_heads} KV heads "
                f"({self.model.names[0]}), but this model has {num_layers} x {num_kv_heads}; "
                f"make its own with `{MAKE_ONE}`"
            )
        missing = [layer for layer in layers if self.scores[layer] is None]
        if missing:
            raise ValueError(f"{where} have no scores for layer(s) {missing}; make them again")

    def check_model(self, model: ModelIdentity) -> None:
        """ValueError when the file was made on a model of another config (fingerprint)."""
        if not self.model.same_config(model):
            raise ValueError(
                f"{self.path or 'the head scores'} were made on another model "
                f"({self.model.names[0]}, {self.model.fingerprint}) than the one loaded "
                f"({model.names[0]}, {model.fingerprint}); make its own with `{MAKE_ONE}`"
            )


def head_scores_json(scores: HeadScores) -> dict[str, object]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {"names": list(scores.model.names), "fingerprint": scores.model.fingerprint},
        "num_layers": scores.num_layers,
        "num_kv_heads": scores.num_kv_heads,
        "scores": [None if row is None else list(row) for row in scores.scores],
        "scoring": scores.scoring,
        "settings": dict(scores.settings),
        "date": scores.date,
        "command": scores.command,
    }


def write_head_scores(scores: HeadScores, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(head_scores_json(scores)) + "\n")


def read_head_scores(path: str | Path) -> HeadScores:
    """Read and validate a head-score file (ValueError naming the file and the problem)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read DuoAttention head scores {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a DuoAttention head-score file (format {FORMAT!r})")
    if raw.get("version") != VERSION:
        raise ValueError(
            f"{path}: head-score file version {raw.get('version')!r} (read: {VERSION})"
        )
    try:
        model = raw["model"]
        names = tuple(str(n) for n in model["names"])
        rows = tuple(None if row is None else tuple(float(s) for s in row) for row in raw["scores"])
        return HeadScores(
            model=ModelIdentity(names, model.get("fingerprint")),
            num_layers=int(raw["num_layers"]),
            num_kv_heads=int(raw["num_kv_heads"]),
            scores=rows,
            scoring=str(raw.get("scoring", "")),
            settings=dict(raw.get("settings", {})),
            date=str(raw.get("date", "")),
            command=str(raw.get("command", "")),
            path=str(path),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(str(path)):
            raise
        raise ValueError(f"{path}: malformed head-score file ({type(e).__name__}: {e})") from None


def find_head_scores(model: ModelIdentity, directory: str | Path | None = None) -> HeadScores:
    """The file in `directory` (default: the shipped ones) that matches `model` by name and
    config fingerprint; ValueError saying how to make one when there is none."""
    folder = Path(directory) if directory is not None else DEFAULT_HEAD_SCORES_DIR
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    found = [s for s in map(read_head_scores, files) if s.model.matches(model)]
    if len(found) > 1:
        raise ValueError(
            f"several head-score files in {folder} match {model.names[0]}: "
            + ", ".join(str(s.path) for s in found)
        )
    if found:
        return found[0]
    out = folder / calibration_file_name(model)
    raise ValueError(
        f"duoattention needs head scores for model {model.names[0]!r} and none ship with "
        f"Sparse-vLLM ({folder}); make them with `sparsevllm calibrate duoattention --model "
        f"MODEL --out {out}`, or pass duoattention_head_scores=FILE (docs/methods.md)"
    )
