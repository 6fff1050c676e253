"""The calibration file: what `sparsevllm calibrate` writes and `auto` budgets read.

One JSON object per model (docs/calibration.md has an example):

- `format` ("sparsevllm-calibration") and `version` (1): a file of another format or a
  newer version is refused rather than misread;
- `model`: the `names` it answers to (file or directory names, HF names) and the
  `fingerprint` of the model's config (null when the reports did not record it);
- `accuracy`: always "relative": a point's accuracy divided by vanilla's (the full
  context) on the same samples, so a floor of 0.95 keeps 95% of the full-context score;
- `methods`: per method, the measured `lengths` (with the longest prompt each covers)
  and the `points`: kept fraction of the prompt, relative and absolute accuracy, samples
  and tasks, at one length each;
- `sources` (the reports, with the conditions they were measured under) and `command`.

Torch-free and dependency-free: the server validates requests with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT = "sparsevllm-calibration"
VERSION = 1
ACCURACY = "relative"
# Relative accuracies are written rounded: 19/20 of vanilla's score reads 0.95, so a
# floor of 0.95 compares as the user means it.
DIGITS = 4


@dataclass(frozen=True)
class Point:
    """One method at one kept fraction and one measured length."""

    length: int  # the quality grid's prompt length (tokens)
    kept_fraction: float  # 1 - compression ratio: budget / length, in (0, 1)
    relative_accuracy: float  # accuracy / vanilla's accuracy on the same samples
    accuracy: float  # mean score (0..1), sample-weighted over tasks and reports
    vanilla_accuracy: float  # vanilla's mean score on the same samples
    num_samples: int
    tasks: tuple[str, ...]


@dataclass(frozen=True)
class Coverage:
    """A measured length and the longest prompt it stands for (the suite's prompts run
    a little over the grid length: its length tolerance, the answer prefix)."""

    length: int
    max_prompt_tokens: int


@dataclass(frozen=True)
class MethodCurve:
    """A method's measured accuracy against its kept fraction, per length."""

    lengths: tuple[Coverage, ...]  # ascending
    points: tuple[Point, ...]

    def points_at(self, length: int) -> list[Point]:
        return [p for p in self.points if p.length == length]


@dataclass(frozen=True)
class ModelIdentity:
    """How a calibration finds its model: any shared name, and equal config
    fingerprints when both sides have one."""

    names: tuple[str, ...]
    fingerprint: str | None = None

    def matches(self, other: ModelIdentity) -> bool:
        return self.shares_a_name(other) and self.same_config(other)

    def shares_a_name(self, other: ModelIdentity) -> bool:
        return bool({n.lower() for n in self.names} & {n.lower() for n in other.names})

    def same_config(self, other: ModelIdentity) -> bool:
        if self.fingerprint is None or other.fingerprint is None:
            return True
        return self.fingerprint == other.fingerprint


@dataclass(frozen=True)
class Source:
    """A report a calibration was made from, and what it measured under."""

    report: str  # its path, as given to `sparsevllm calibrate`
    model: str
    dtype: str | None
    device: str | None
    chat: bool
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    git_commit: str | None
    excluded_methods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Calibration:
    model: ModelIdentity
    methods: Mapping[str, MethodCurve]
    sources: tuple[Source, ...]
    command: str
    path: str | None = None  # where it was read from (for messages)

    def curve(self, method: str) -> MethodCurve:
        if method not in self.methods:
            measured = ", ".join(sorted(self.methods)) or "none"
            raise ValueError(
                f"the calibration of {self.model.names[0]} ({self.path or 'in memory'}) has no "
                f"points for method {method!r} (it has: {measured}); run `sparsevllm bench "
                f"quality --methods vanilla,{method}` on this model and calibrate again"
            )
        return self.methods[method]


# -- writing ------------------------------------------------------------------------------


def to_json(cal: Calibration) -> dict[str, object]:
    """The file's JSON object (the order of keys is the documented one)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {"names": list(cal.model.names), "fingerprint": cal.model.fingerprint},
        "accuracy": ACCURACY,
        "methods": {name: _curve_json(curve) for name, curve in sorted(cal.methods.items())},
        "sources": [_source_json(s) for s in cal.sources],
        "command": cal.command,
    }


def _curve_json(curve: MethodCurve) -> dict[str, object]:
    return {
        "lengths": [
            {"length": c.length, "max_prompt_tokens": c.max_prompt_tokens} for c in curve.lengths
        ],
        "points": [
            {
                "length": p.length,
                "kept_fraction": p.kept_fraction,
                "relative_accuracy": round(p.relative_accuracy, DIGITS),
                "accuracy": round(p.accuracy, DIGITS),
                "vanilla_accuracy": round(p.vanilla_accuracy, DIGITS),
                "num_samples": p.num_samples,
                "tasks": list(p.tasks),
            }
            for p in sorted(curve.points, key=lambda p: (p.length, -p.kept_fraction))
        ],
    }


def _source_json(s: Source) -> dict[str, object]:
    out: dict[str, object] = {
        "report": s.report,
        "model": s.model,
        "dtype": s.dtype,
        "device": s.device,
        "chat": s.chat,
        "tasks": list(s.tasks),
        "lengths": list(s.lengths),
        "samples": s.samples,
        "git_commit": s.git_commit,
    }
    if s.excluded_methods:
        out["excluded_methods"] = list(s.excluded_methods)
    return out


def write_calibration(cal: Calibration, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(to_json(cal)) + "\n")


def dumps(value: object, indent: str = "") -> str:
    """JSON that reads like a table: an object or list with no object inside it (a
    point, a source) is written on one line, everything around it indented."""
    if not _holds_objects(value):
        return json.dumps(value)
    inner = indent + "  "
    if isinstance(value, list):
        items = [inner + dumps(v, inner) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + indent + "]"
    assert isinstance(value, dict)
    fields = [f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(fields) + "\n" + indent + "}"


def _holds_objects(value: object) -> bool:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return any(isinstance(v, dict) or _holds_objects(v) for v in items)


# -- reading ------------------------------------------------------------------------------


def read_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file; a ValueError names the file and the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"calibration file {path}: cannot read it as JSON ({e})") from None
    return from_json(data, str(path))


def from_json(data: object, where: str) -> Calibration:
    """The Calibration a file's JSON holds (`where` names it in errors)."""
    top = _mapping(data, where)
    if top.get("format") != FORMAT:
        raise ValueError(f"{where} is not a calibration file (format is not {FORMAT!r})")
    if top.get("version") != VERSION:
        raise ValueError(
            f"{where} has calibration format version {top.get('version')!r}; this sparsevllm "
            f"reads version {VERSION} (make it again with this version's `sparsevllm calibrate`)"
        )
    if top.get("accuracy") != ACCURACY:
        raise ValueError(f"{where}: accuracy must be {ACCURACY!r}")
    model = _mapping(top.get("model"), f"{where}: model")
    names = tuple(_strings(model.get("names"), f"{where}: model.names"))
    if not names:
        raise ValueError(f"{where}: model.names must name the model")
    fingerprint = model.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ValueError(f"{where}: model.fingerprint must be a string or null")
    methods = _mapping(top.get("methods"), f"{where}: methods")
    curves = {name: _curve(value, f"{where}: methods.{name}") for name, value in methods.items()}
    sources = [_source(s, f"{where}: sources") for s in _list(top.get("sources"), "sources")]
    command = top.get("command")
    return Calibration(
        ModelIdentity(names, fingerprint),
        curves,
        tuple(sources),
        command if isinstance(command, str) else "",
        where,
    )


def _curve(data: object, where: str) -> MethodCurve:
    obj = _mapping(data, where)
    listed = [_mapping(c, f"{where}.lengths") for c in _list(obj.get("lengths"), where)]
    lengths = tuple(
        Coverage(_int(c, "length", where), _int(c, "max_prompt_tokens", where)) for c in listed
    )
    points = tuple(_point(p, f"{where}.points") for p in _list(obj.get("points"), where))
    measured = {c.length for c in lengths}
    if not points or {p.length for p in points} != measured:
        raise ValueError(f"{where}: every listed length needs points, and every point a length")
    keys = [(p.length, p.kept_fraction) for p in points]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{where}: two points at the same length and kept fraction")
    return MethodCurve(tuple(sorted(lengths, key=lambda c: c.length)), points)


def _point(data: object, where: str) -> Point:
    obj = _mapping(data, where)
    fraction = _number(obj, "kept_fraction", where)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"{where}: kept_fraction must lie in (0, 1), got {fraction}")
    return Point(
        length=_int(obj, "length", where),
        kept_fraction=fraction,
        relative_accuracy=_number(obj, "relative_accuracy", where),
        accuracy=_number(obj, "accuracy", where),
        vanilla_accuracy=_number(obj, "vanilla_accuracy", where),
        num_samples=_int(obj, "num_samples", where),
        tasks=tuple(_strings(obj.get("tasks"), f"{where}.tasks")),
    )


def _source(data: object, where: str) -> Source:
    obj = _mapping(data, where)

    def text(key: str) -> str | None:
        value = obj.get(key)
        return value if isinstance(value, str) else None

    samples = obj.get("samples")

    return Source(
        report=text("report") or "",
        model=text("model") or "",
        dtype=text("dtype"),
        device=text("device"),
        chat=obj.get("chat") is True,
        tasks=tuple(_strings(obj.get("tasks", []), f"{where}.tasks")),
        lengths=tuple(int(n) for n in _list(obj.get("lengths", []), where) if isinstance(n, int)),
        samples=samples if isinstance(samples, int) and not isinstance(samples, bool) else 0,
        git_commit=text("git_commit"),
        excluded_methods=tuple(_strings(obj.get("excluded_methods", []), where)),
    )


def _mapping(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object")
    return value


def _list(value: object, where: str) -> Sequence[object]:
    if not isinstance(value, list):
        raise ValueError(f"{where} must hold a list")
    return value


def _strings(value: object, where: str) -> list[str]:
    items = _list(value, where)
    if not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{where} must be a list of non-empty strings")
    return [str(s) for s in items]


def _int(obj: Mapping[str, object], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _number(obj: Mapping[str, object], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    return float(value)
