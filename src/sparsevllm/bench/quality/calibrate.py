"""Quality reports -> a calibration file (`sparsevllm calibrate`; the rule that reads it
is sparsevllm/calibration/budget.py, the format calibration/schema.py).

Each row of a sparse method (a ratio r > 0 at one task and length) is paired with
vanilla's row on the same samples: from its own report, else from another report given
that measured vanilla under the same conditions (task, length, samples, seed, dtype,
prompt format). The rows of one method, length and ratio are then pooled over tasks and
reports, weighted by samples:

    relative accuracy = sum(method score) / sum(vanilla score)   (scores = accuracy x samples)

so a task vanilla never solves carries no weight, and the point's kept fraction is
1 - r. A method's ratios at one length must cover the same samples (one curve).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sparsevllm.bench.quality.layout import LENGTH_TOLERANCE
from sparsevllm.bench.quality.reports import REFERENCE, QualityReport, Row
from sparsevllm.calibration import (
    Calibration,
    Coverage,
    MethodCurve,
    ModelIdentity,
    Point,
    Source,
)


@dataclass
class _Pool:
    """The rows of one (method, length, ratio), summed."""

    score: float = 0.0  # the method's summed scores
    reference: float = 0.0  # vanilla's, on the same samples
    samples: int = 0
    tasks: dict[str, None] = field(default_factory=dict)  # ordered set
    cells: set[tuple[int, str, int]] = field(default_factory=set)  # (report, task, samples)
    prompt_tokens: float = 0.0  # the largest mean prompt of its rows

    def add(self, index: int, row: Row, reference: Row) -> None:
        self.score += row.accuracy * row.num_samples
        self.reference += reference.accuracy * reference.num_samples
        self.samples += row.num_samples
        self.tasks[row.task] = None
        self.cells.add((index, row.task, row.num_samples))
        self.prompt_tokens = max(self.prompt_tokens, row.mean_prompt_tokens or 0.0)


def build_calibration(
    reports: Sequence[QualityReport],
    command: str,
    exclude: Mapping[int, set[str]] | None = None,
    names: Sequence[str] = (),
) -> Calibration:
    """The calibration of the reports' model. `exclude`: methods left out of a report
    (by its index); `names`: more names the model answers to."""
    if not reports:
        raise ValueError("give at least one quality report")
    exclude = exclude or {}
    identity = _identity(reports, names)
    pools = _pools(reports, exclude)
    if not pools:
        raise ValueError(
            "the reports hold no sparse-method rows (only vanilla, or every method excluded)"
        )
    methods = sorted({method for method, _, _ in pools})
    curves = {m: _curve(m, {k: p for k, p in pools.items() if k[0] == m}) for m in methods}
    sources = tuple(_source(r, exclude.get(i, set())) for i, r in enumerate(reports))
    return Calibration(identity, curves, sources, command)


def _identity(reports: Sequence[QualityReport], extra: Sequence[str]) -> ModelIdentity:
    models = {r.model for r in reports}
    if len(models) > 1:
        measured = ", ".join(f"{r.path} measured {r.model!r}" for r in reports)
        raise ValueError(f"the reports are of different models ({measured}); calibrate each alone")
    prints = {r.identity["fingerprint"] for r in reports} - {None}
    if len(prints) > 1:
        raise ValueError(f"the reports' model configs differ (fingerprints {sorted(prints)})")
    names = [n for r in reports for n in r.identity["names"]] + list(extra)
    return ModelIdentity(tuple(dict.fromkeys(names)), prints.pop() if prints else None)


def _pools(
    reports: Sequence[QualityReport], exclude: Mapping[int, set[str]]
) -> dict[tuple[str, int, float], _Pool]:
    own, shared = _references(reports)
    pools: dict[tuple[str, int, float], _Pool] = {}
    for index, report in enumerate(reports):
        for row in report.rows:
            if row.method == REFERENCE or row.method in exclude.get(index, set()):
                continue
            condition = report.condition(row)
            reference = own.get((index, condition)) or shared.get(condition)
            if reference is None:
                raise ValueError(_no_reference(report, row))
            key = (row.method, row.length, row.ratio)
            pools.setdefault(key, _Pool()).add(index, row, reference)
    return pools


def _references(
    reports: Sequence[QualityReport],
) -> tuple[dict[tuple[int, tuple[object, ...]], Row], dict[tuple[object, ...], Row]]:
    """Vanilla's rows by (report, condition), and by condition alone (first report wins)."""
    own: dict[tuple[int, tuple[object, ...]], Row] = {}
    shared: dict[tuple[object, ...], Row] = {}
    for index, report in enumerate(reports):
        for row in report.rows:
            if row.method == REFERENCE:
                own[(index, report.condition(row))] = row
                shared.setdefault(report.condition(row), row)
    return own, shared


def _no_reference(report: QualityReport, row: Row) -> str:
    seed = report.metadata["grid"].get("seed")
    return (
        f"{report.path}: no vanilla row for {row.task} at {row.length} tokens to compare "
        f"{row.method} with, in it or in another report given with the same samples "
        f"({row.num_samples} samples, seed {seed}, dtype {report.dtype}, chat {report.chat}); "
        "run the grid with --methods vanilla,... or add such a report"
    )


def _curve(method: str, pools: Mapping[tuple[str, int, float], _Pool]) -> MethodCurve:
    points, lengths = [], []
    for length in sorted({length for _, length, _ in pools}):
        at = {ratio: p for (_, n, ratio), p in pools.items() if n == length}
        if len({frozenset(p.cells) for p in at.values()}) > 1:
            raise ValueError(
                f"{method} at {length} tokens: its ratios were measured on different samples "
                "(tasks, reports or counts); a curve needs the same samples at every ratio"
            )
        points += [_point(method, length, ratio, pool) for ratio, pool in sorted(at.items())]
        longest = max(p.prompt_tokens for p in at.values())
        reach = max(math.ceil(length * (1 + LENGTH_TOLERANCE)), math.ceil(longest))
        lengths.append(Coverage(length, reach))
    return MethodCurve(tuple(lengths), tuple(points))


def _point(method: str, length: int, ratio: float, pool: _Pool) -> Point:
    if pool.reference <= 0:
        raise ValueError(
            f"{method} at {length} tokens, ratio {ratio:g}: vanilla scored 0 on every sample "
            f"it is compared on ({', '.join(pool.tasks)}), so accuracy relative to it is "
            "undefined; measure tasks this model can do"
        )
    return Point(
        length=length,
        kept_fraction=round(1.0 - ratio, 6),
        relative_accuracy=pool.score / pool.reference,
        accuracy=pool.score / pool.samples,
        vanilla_accuracy=pool.reference / pool.samples,
        num_samples=pool.samples,
        tasks=tuple(pool.tasks),
    )


def _source(report: QualityReport, excluded: set[str]) -> Source:
    meta, grid = report.metadata, report.metadata["grid"]
    versions = meta.get("versions") or {}
    return Source(
        report=report.path,
        model=str(meta["model"]),
        dtype=report.dtype,
        device=meta.get("device"),
        chat=report.chat,
        tasks=tuple(grid.get("tasks") or ()),
        lengths=tuple(grid.get("lengths") or ()),
        samples=int(grid.get("samples") or 0),
        git_commit=versions.get("git_commit"),
        excluded_methods=tuple(sorted(excluded)),
    )


def resolve_exclusions(
    reports: Sequence[QualityReport], specs: Sequence[str]
) -> dict[int, set[str]]:
    """`REPORT:METHOD` strings (REPORT: a path as given, or its file name) -> methods to
    leave out, by report index; a spec that names no report or no method of it fails."""
    out: dict[int, set[str]] = {}
    for spec in specs:
        where, sep, method = spec.rpartition(":")
        hits = [i for i, r in enumerate(reports) if where in (r.path, r.path.rsplit("/", 1)[-1])]
        if not sep or not where or not method:
            raise ValueError(f"--exclude takes REPORT:METHOD, got {spec!r}")
        if not hits:
            raise ValueError(f"--exclude {spec}: {where!r} is none of the reports given")
        for i in hits:
            if method not in {row.method for row in reports[i].rows}:
                raise ValueError(f"--exclude {spec}: {reports[i].path} has no {method!r} rows")
            out.setdefault(i, set()).add(method)
    return out
