"""Reading `bench quality --json` reports back: checked rows, the model they measured,
and the conditions vanilla's rows were measured under (for `sparsevllm calibrate`).

Only the query-aware rows are read: a calibration states how much of vanilla's accuracy
a budget keeps when the method sees the question, as every calibration made before the
query-agnostic mode existed did (a row without a mode is query-aware)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparsevllm.bench.quality.grid import BUDGET_RULE, QUERY_AWARE

REFERENCE = "vanilla"  # the full-context method every ratio is compared with


@dataclass(frozen=True)
class Row:
    """One (method, ratio, task, length) result row with samples."""

    method: str
    ratio: float
    task: str
    length: int
    budget: int | None
    num_samples: int
    accuracy: float
    mean_prompt_tokens: float | None


@dataclass(frozen=True)
class QualityReport:
    path: str  # as given
    metadata: dict[str, Any]
    rows: list[Row]

    @property
    def model(self) -> str:
        """The model's file or directory name (where it lay differs between machines)."""
        return Path(str(self.metadata["model"]).rstrip("/")).name

    @property
    def identity(self) -> dict[str, Any]:
        """`names` and `fingerprint` as the run recorded them (reports before that: the
        file name, no fingerprint)."""
        recorded = self.metadata.get("model_identity")
        if isinstance(recorded, dict) and recorded.get("names"):
            return {"names": list(recorded["names"]), "fingerprint": recorded.get("fingerprint")}
        return {"names": [self.model], "fingerprint": None}

    def condition(self, row: Row) -> tuple[object, ...]:
        """What must be equal for another report's vanilla row to be this row's
        reference: the same samples (task, length, count, seed), dtype and prompt format."""
        grid = self.metadata["grid"]
        return (row.task, row.length, row.num_samples, grid.get("seed"), self.dtype, self.chat)

    @property
    def dtype(self) -> str | None:
        return self.metadata.get("dtype")

    @property
    def chat(self) -> bool:
        return bool(self.metadata.get("chat"))


def load_report(path: str) -> QualityReport:
    """Read a report; a ValueError names the file and what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, dict) or not all(k in data for k in ("metadata", "results")):
        raise ValueError(
            f"{path} is not a `sparsevllm bench quality --json` report (it has no metadata "
            "and results)"
        )
    meta = data["metadata"]
    if not isinstance(meta, dict) or not isinstance(meta.get("grid"), dict):
        raise ValueError(f"{path} is not a quality report: its metadata has no grid")
    if not isinstance(meta.get("model"), str) or not meta["model"].strip("/"):
        raise ValueError(f"{path}: metadata.model must name the model")
    if meta.get("budget_rule") != BUDGET_RULE:
        raise ValueError(
            f"{path} states another budget rule ({meta.get('budget_rule')!r}); a calibration "
            f"reads its ratios as {BUDGET_RULE!r}"
        )
    if not isinstance(data["results"], list):
        raise ValueError(f"{path}: results must be a list of rows")
    rows = [_row(r, f"{path}: results[{i}]") for i, r in enumerate(data["results"])]
    return QualityReport(path, meta, [r for r in rows if r is not None])


def _row(data: object, where: str) -> Row | None:
    """A checked row; None for a cell without samples (a grid cell not run yet) and for
    a row of another mode than query-aware."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object")
    if data.get("mode", QUERY_AWARE) != QUERY_AWARE:
        return None  # a query-agnostic row: not what a calibration describes
    missing = [k for k in ("method", "ratio", "task", "length", "num_samples") if k not in data]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    if not data["num_samples"] or data.get("accuracy") is None:
        return None
    row = Row(
        method=str(data["method"]),
        ratio=_number(data["ratio"], where, "ratio"),
        task=str(data["task"]),
        length=int(_number(data["length"], where, "length")),
        budget=data.get("budget"),
        num_samples=int(_number(data["num_samples"], where, "num_samples")),
        accuracy=_number(data["accuracy"], where, "accuracy"),
        mean_prompt_tokens=data.get("mean_prompt_tokens"),
    )
    if not 0.0 <= row.accuracy <= 1.0 or not 0.0 <= row.ratio < 1.0 or row.length < 1:
        raise ValueError(f"{where}: accuracy must lie in [0, 1], ratio in [0, 1), length >= 1")
    if (row.method == REFERENCE) != (row.ratio == 0.0):
        raise ValueError(f"{where}: vanilla runs at ratio 0 and only vanilla does")
    return row


def _number(value: object, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)
