"""Calibrated `auto` budgets: `sparsevllm calibrate` turns quality reports into a
calibration file; `choose_budget` picks the smallest budget whose calibrated accuracy
meets a floor (a stricter floor never a smaller one; an unsatisfiable floor: the full
context); `find_calibration` finds a model's file or says how to make one."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.bench.quality.grid import BUDGET_RULE
from sparsevllm.calibration import (
    DEFAULT_CALIBRATION_DIR,
    Calibration,
    CalibrationNotFound,
    Coverage,
    MethodCurve,
    ModelIdentity,
    Point,
    choose_budget,
    find_calibration,
    from_json,
    model_identity,
    model_names,
    read_calibration,
    to_json,
    write_calibration,
)
from sparsevllm.cli import main

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = DEFAULT_CALIBRATION_DIR / "gemma-3-270m-q4_k_m.json"
GEMMA = "/anywhere/gemma-3-270m-q4_k_m.gguf"


def row(method: str, ratio: float, task: str, accuracy: float, length: int = 1000, n: int = 10):
    budget = None if method == "vanilla" else round((1 - ratio) * length)
    return {
        "method": method,
        "ratio": ratio,
        "task": task,
        "length": length,
        "budget": budget,
        "num_samples": n,
        "accuracy": accuracy,
        "exact_match": accuracy,
        "mean_prompt_tokens": length + 12.5,
    }


def report(rows: list[dict[str, Any]], model: str = "/m/tiny.gguf", **meta: Any) -> dict:
    grid = {
        "tasks": sorted({r["task"] for r in rows}),
        "lengths": sorted({r["length"] for r in rows}),
        "samples": max(r["num_samples"] for r in rows),
        "methods": sorted({r["method"] for r in rows}),
        "ratios": sorted({r["ratio"] for r in rows} - {0.0}),
        "seed": 0,
    }
    metadata = {"model": model, "dtype": "float32", "device": "cpu", "grid": grid,
                "chat": False, "budget_rule": BUDGET_RULE, "versions": {"git_commit": "abc1234"},
                **meta}  # fmt: skip
    return {"metadata": metadata, "results": rows, "summary": []}


# Vanilla solves 8/10 of task a and 2/10 of b; snapkv keeps all at 0.5 and some at 0.9.
ROWS = [
    row("vanilla", 0.0, "a", 0.8),
    row("vanilla", 0.0, "b", 0.2),
    row("snapkv", 0.5, "a", 0.8),
    row("snapkv", 0.5, "b", 0.2),
    row("snapkv", 0.9, "a", 0.6),
    row("snapkv", 0.9, "b", 0.1),
]


def write(tmp_path: Path, name: str, data: object) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def calibrate(*args: str) -> int:
    return main(["calibrate", *args])


def test_calibrate_pools_tasks_relative_to_vanilla(tmp_path: Path, capsys) -> None:
    source = write(tmp_path, "q.json", report(ROWS))
    out = tmp_path / "cal" / "tiny.json"
    assert calibrate(source, "--name", "tiny-hf", "--out", str(out)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["model"] == ["tiny.gguf", "tiny-hf"]
    data = json.loads(out.read_text())
    assert (data["format"], data["version"], data["accuracy"]) == (
        "sparsevllm-calibration",
        1,
        "relative",
    )
    curve = data["methods"]["snapkv"]
    assert curve["lengths"] == [{"length": 1000, "max_prompt_tokens": 1020}]
    # Pooled over tasks by samples: (6 + 1) / (8 + 2) of vanilla's score at ratio 0.9.
    points = {p["kept_fraction"]: p for p in curve["points"]}
    assert points[0.5]["relative_accuracy"] == 1.0 and points[0.1]["relative_accuracy"] == 0.7
    assert points[0.1]["accuracy"] == 0.35 and points[0.1]["vanilla_accuracy"] == 0.5
    assert points[0.1]["num_samples"] == 20 and points[0.1]["tasks"] == ["a", "b"]
    assert data["sources"][0]["report"] == source and data["sources"][0]["git_commit"] == "abc1234"
    assert data["command"] == shlex.join(
        ["sparsevllm", "calibrate", source, "--name", "tiny-hf", "--out", str(out)]
    )
    cal = read_calibration(out)
    assert choose_budget(cal, "snapkv", 0.7, 1000) == 100
    assert choose_budget(cal, "snapkv", 0.8, 1000) == 500


def test_vanilla_from_another_report_of_the_same_samples(tmp_path: Path, capsys) -> None:
    vanilla = write(tmp_path, "v.json", report(ROWS[:2]))
    methods = write(tmp_path, "m.json", report(ROWS[2:]))
    out = tmp_path / "c.json"
    assert calibrate(methods, vanilla, "--out", str(out)) == 0
    points = read_calibration(out).methods["snapkv"].points
    assert sorted(p.relative_accuracy for p in points) == [0.7, 1.0]
    other_dtype = write(tmp_path, "v16.json", report(ROWS[:2], dtype="bfloat16"))
    capsys.readouterr()
    assert calibrate(methods, other_dtype, "--out", str(out)) == 2
    assert "m.json: no vanilla row for a at 1000 tokens" in capsys.readouterr().err


def check_error(tmp_path: Path, capsys, reports: list[object], match: str, *flags: str) -> None:
    paths = [write(tmp_path, f"r{i}.json", r) for i, r in enumerate(reports)]
    assert calibrate(*paths, *flags, "--out", str(tmp_path / "never.json")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(match, err), err
    assert not (tmp_path / "never.json").exists()


@pytest.mark.parametrize(
    "reports, match",
    [
        (["{not json"], "r0.json is not JSON"),
        ([{"model": "x", "formats": []}], r"is not a `sparsevllm bench quality --json` report"),
        ([[1, 2]], "is not a `sparsevllm bench quality"),
        ([report(ROWS, budget_rule="budget = ratio")], "states another budget rule"),
        ([report(ROWS), report(ROWS, model="/m/other")], "different models .*'tiny.gguf'.*'other'"),
        ([report(ROWS[2:])], "no vanilla row for a at 1000 tokens"),
        ([report(ROWS[:2])], "hold no sparse-method rows"),
        ([report([row("vanilla", 0.0, "a", 0), row("snapkv", 0.5, "a", 0)])], "vanilla scored 0"),
        ([report([*ROWS[:4], row("snapkv", 0.9, "a", 0.6)])], "measured on different samples"),
        ([report([row("vanilla", 0.0, "a", 1.5)])], r"accuracy must lie in \[0, 1\]"),
    ],
)
def test_bad_reports_are_clear_errors(tmp_path: Path, capsys, reports, match) -> None:
    check_error(tmp_path, capsys, reports, match)


@pytest.mark.parametrize(
    "flag, match",
    [
        ("r0.json:snapkv", "hold no sparse-method rows"),
        ("r1.json:snapkv", "'r1.json' is none of the reports given"),
        ("r0.json:quest", "has no 'quest' rows"),
        ("snapkv", "takes REPORT:METHOD"),
    ],
)
def test_exclude(tmp_path: Path, capsys, flag: str, match: str) -> None:
    check_error(tmp_path, capsys, [report(ROWS)], match, "--exclude", flag)


def test_help_explains_every_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("REPORT.json", "--out", "--name", "--exclude", "vanilla", "relative"):
        assert flag in text, flag


# -- the committed calibration ------------------------------------------------------------


def documented_command() -> list[str]:
    """The `sparsevllm calibrate` command of docs/calibration.md that made the file."""
    doc = (ROOT / "docs" / "calibration.md").read_text()
    match = re.search(r"^sparsevllm calibrate docs/quality/.*?[^\\]$", doc, re.M | re.S)
    assert match is not None
    return shlex.split(match.group(0).replace("\\\n", " "))


def test_the_committed_calibration_is_what_the_documented_command_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    words = documented_command()
    at = words.index("--out")
    assert ROOT / words[at + 1] == COMMITTED
    monkeypatch.chdir(ROOT)  # the report paths are relative to the repository
    assert main([*words[1 : at + 1], str(tmp_path / "again.json"), *words[at + 2 :]]) == 0
    made = json.loads((tmp_path / "again.json").read_text())
    committed = json.loads(COMMITTED.read_text())
    assert committed["command"] == shlex.join(words)
    assert {k: v for k, v in made.items() if k != "command"} == {
        k: v for k, v in committed.items() if k != "command"
    }


def test_committed_calibration_stricter_floor_larger_budget() -> None:
    cal = find_calibration(model_identity(GEMMA))  # the default directory
    assert cal.path == str(COMMITTED)
    # PyramidKV keeps 88% of vanilla's score at 10% of a 4K prompt, 92% at 25%, all at 50%.
    budgets = [choose_budget(cal, "pyramidkv", floor, 4096) for floor in (0.8, 0.9, 0.95, 1.0)]
    assert budgets == [410, 1024, 2048, 2048]
    assert choose_budget(cal, "snapkv", 0.95, 4096) == 410
    # Unsatisfiable: TOVA keeps 88% at best, StreamingLLM 54%, Knorm nothing.
    assert choose_budget(cal, "tova", 0.95, 4096) is None
    assert choose_budget(cal, "knorm", 0.01, 4096) is None
    # Beyond the measured 4K (+2%): the full context; shorter: at least the 4K budget.
    assert choose_budget(cal, "quest", 0.99, 4178) == 418
    assert choose_budget(cal, "quest", 0.99, 4179) is None
    assert choose_budget(cal, "quest", 0.99, 1000) == 410
    assert choose_budget(cal, "quest", 0.99, 400) is None


# -- the rule -----------------------------------------------------------------------------


def curve(points: dict[float, float], length: int = 4096) -> MethodCurve:
    """One length's kept fraction -> relative accuracy."""
    made = tuple(Point(length, f, a, a / 2, 0.5, 20, ("t",)) for f, a in points.items())
    return MethodCurve((Coverage(length, length + 80),), made)


def calibration(**methods: MethodCurve) -> Calibration:
    return Calibration(ModelIdentity(("m",)), methods, (), "test")


def test_a_stricter_floor_gives_a_strictly_larger_budget() -> None:
    cal = calibration(x=curve({0.5: 1.0, 0.25: 0.97, 0.1: 0.9}))
    assert [choose_budget(cal, "x", a, 4096) for a in (0.0, 0.9, 0.95, 0.99, 1.0)] == [
        410,
        410,
        1024,
        2048,
        2048,
    ]
    # A dip at a larger fraction is not jumped over: 0.1 passes 0.95, 0.5 does not.
    noisy = calibration(x=curve({0.5: 0.94, 0.25: 1.0, 0.1: 0.96}))
    assert choose_budget(noisy, "x", 0.95, 4096) is None
    assert choose_budget(noisy, "x", 0.94, 4096) == 410


def test_lengths_between_and_beyond_the_measured_ones() -> None:
    short = curve({0.5: 1.0, 0.1: 1.0}, 1024)
    long = curve({0.5: 1.0, 0.1: 0.8}, 8192)
    cal = calibration(x=MethodCurve(short.lengths + long.lengths, short.points + long.points))
    assert choose_budget(cal, "x", 0.9, 1024) == 103  # 1,024's own curve
    assert choose_budget(cal, "x", 0.9, 4000) == 2000  # the stricter of 1,024 and 8,192
    assert choose_budget(cal, "x", 0.9, 8272) == 4136  # 8,192 covers up to 8,272
    assert choose_budget(cal, "x", 0.9, 8273) is None  # beyond every measured length
    assert choose_budget(cal, "x", 0.9, 600) == 103  # below: never fewer than 1,024's budget


def test_bad_arguments() -> None:
    cal = calibration(x=curve({0.5: 1.0}))
    for floor in (-0.1, 1.01, True):
        with pytest.raises(ValueError, match="min_accuracy"):
            choose_budget(cal, "x", floor, 4096)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prompt_len must be a positive integer"):
        choose_budget(cal, "x", 0.9, 0)
    with pytest.raises(ValueError, match=r"no points for method 'quest' .*--methods vanilla,quest"):
        choose_budget(cal, "quest", 0.9, 4096)


FRACTIONS = st.sampled_from([0.05, 0.1, 0.25, 0.5, 0.75, 0.9])


@st.composite
def curves(draw: st.DrawFn) -> Calibration:
    lengths = sorted(draw(st.sets(st.sampled_from([512, 1024, 4096, 16384]), min_size=1)))
    points = [
        Point(n, f, draw(st.floats(0.0, 1.2)), 0.5, 0.5, 10, ("t",))
        for n in lengths
        for f in draw(st.sets(FRACTIONS, min_size=1))
    ]
    reach = tuple(Coverage(n, n + draw(st.integers(0, 400))) for n in lengths)
    return calibration(x=MethodCurve(reach, tuple(points)))


def tokens(budget: int | None) -> float:
    return float("inf") if budget is None else budget


LENGTHS = st.one_of(st.integers(1, 20000), st.sampled_from([512, 1024, 4096, 16384]))


@settings(max_examples=300, deadline=None)
@given(curves(), st.floats(0.0, 1.0), st.floats(0.0, 1.0), LENGTHS)
def test_a_stricter_floor_never_gives_a_smaller_budget(cal, a, b, n) -> None:
    loose, strict = sorted((a, b))
    low, high = choose_budget(cal, "x", loose, n), choose_budget(cal, "x", strict, n)
    assert tokens(low) <= tokens(high)
    assert high is None or 1 <= high < n
    # Every point of the prompt's length that kept at least the budget meets the floor.
    if high is not None:
        measured = cal.methods["x"].points_at(n)
        assert all(p.relative_accuracy >= strict for p in measured if p.kept_fraction * n >= high)


# -- files and lookup ---------------------------------------------------------------------


def test_round_trip_and_format_checks(tmp_path: Path) -> None:
    cal = read_calibration(COMMITTED)
    write_calibration(cal, tmp_path / "copy.json")
    assert to_json(read_calibration(tmp_path / "copy.json")) == to_json(cal)
    data = to_json(cal)
    with pytest.raises(ValueError, match="version 2; this sparsevllm reads version 1"):
        from_json({**data, "version": 2}, "f.json")
    with pytest.raises(ValueError, match="f.json is not a calibration file"):
        from_json({**data, "format": "other"}, "f.json")
    bad = json.loads(json.dumps(data))
    bad["methods"]["snapkv"]["points"][0]["kept_fraction"] = 1.0
    with pytest.raises(ValueError, match=r"kept_fraction must lie in \(0, 1\)"):
        from_json(bad, "f.json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        read_calibration(write(tmp_path, "broken.json", "{"))


def test_model_names_and_fingerprints() -> None:
    assert model_names("/models/Llama-3.2-1B-Instruct/") == ("Llama-3.2-1B-Instruct",)
    assert model_names("/tmp/x/config.json") == ("x",)
    hf = {"_name_or_path": "meta-llama/Llama-3.2-1B", "model_type": "llama", "hidden_size": 2048}
    assert model_names("/m/llama", hf) == ("llama", "Llama-3.2-1B")
    same = model_identity("/a/llama", {**hf, "torch_dtype": "float16"})
    assert same.fingerprint == model_identity("/b/llama", hf).fingerprint  # storage aside
    assert model_identity("/a/llama", {**hf, "hidden_size": 4096}).fingerprint != same.fingerprint


def test_a_missing_calibration_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(CalibrationNotFound) as e:
        find_calibration(model_identity("/models/Qwen3-0.6B"))
    message = str(e.value)
    assert "no calibration for model 'Qwen3-0.6B'" in message
    assert "sparsevllm bench quality --model MODEL --json quality.json" in message
    assert f"sparsevllm calibrate quality.json --out {DEFAULT_CALIBRATION_DIR}/Qwen3-0.6B.json" in (
        message
    )
    with pytest.raises(CalibrationNotFound, match="no such directory"):
        find_calibration(model_identity(GEMMA), tmp_path / "none")


def test_lookup_by_name_and_fingerprint(tmp_path: Path) -> None:
    cal = read_calibration(COMMITTED)
    marked = Calibration(ModelIdentity(("llama",), "sha256:1"), cal.methods, (), "")
    write_calibration(marked, tmp_path / "llama.json")
    assert find_calibration(ModelIdentity(("LLAMA",), None), tmp_path).path == str(
        tmp_path / "llama.json"
    )
    with pytest.raises(CalibrationNotFound, match="measured on another config"):
        find_calibration(ModelIdentity(("llama",), "sha256:2"), tmp_path)
    write_calibration(marked, tmp_path / "llama2.json")
    with pytest.raises(ValueError, match="several calibrations"):
        find_calibration(ModelIdentity(("llama",), "sha256:1"), tmp_path)
