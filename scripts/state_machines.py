"""The long run of the property-based state machines: the scheduler + KV pool + device
slot tables (+ radix store and its tiers), and the prefix-store protocol (radix and
chain stores, no tier / host tier / host then disk tier), until at least `--steps` rules
have run with the invariants checked after each one.

    PYTHONPATH=src:tests python scripts/state_machines.py --steps 10000 \
        --json docs/reliability/state_machines.json

Prints (and writes) JSON: steps and examples per machine, and every invariant violation
(hypothesis' shrunk example). Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import invariant, run_state_machine_as_test  # noqa: E402

from scheduler_machine import machine_class  # noqa: E402


def _store_machine() -> Any:
    path = ROOT / "tests" / "engine" / "test_store_properties.py"
    spec = importlib.util.spec_from_file_location("store_properties", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StoreMachine


def machines() -> dict[str, type]:
    store = _store_machine()
    out: dict[str, type] = {}
    for tiers in ("none", "cpu", "cpu+disk"):
        for kind in ("radix", "chain"):
            out[f"store/{kind}/{tiers}"] = type(
                f"Store_{kind}_{tiers}", (store,), {"kind": kind, "tiers": tiers}
            )
    out["scheduler/dense"] = machine_class(None)
    for tiers in ("none", "cpu", "cpu+disk"):
        out[f"scheduler/radix/{tiers}"] = machine_class("radix", tiers)
    return out


def counted(machine: type, counter: dict[str, int]) -> type:
    """`machine` with one more invariant that counts the checks (one per rule run)."""

    class Counted(machine):  # type: ignore[misc, valid-type]
        @invariant()
        def count_step(self) -> None:
            counter["steps"] += 1

    Counted.__name__ = machine.__name__
    return Counted


def run_one(machine: type, steps: int, step_count: int) -> dict[str, Any]:
    counter = {"steps": 0, "examples": 0}
    violations: list[str] = []
    while counter["steps"] < steps and not violations:
        config = settings(
            max_examples=20,
            stateful_step_count=step_count,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        try:
            run_state_machine_as_test(counted(machine, counter), settings=config)
        except Exception as e:  # an invariant or an assertion in a rule failed
            violations.append("".join(traceback.format_exception(e))[-4000:])
        counter["examples"] += 20
    return {**counter, "violations": violations}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="total rules, at least")
    parser.add_argument("--step-count", type=int, default=50, help="rules per example")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    all_machines = machines()
    per_machine = -(-args.steps // len(all_machines))
    started = time.monotonic()
    results = {}
    for name, machine in all_machines.items():
        t0 = time.monotonic()
        results[name] = run_one(machine, per_machine, args.step_count)
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(results[name]), flush=True)
    report = {
        "command": " ".join(sys.argv),
        "total_steps": sum(r["steps"] for r in results.values()),
        "total_examples": sum(r["examples"] for r in results.values()),
        "total_violations": sum(len(r["violations"]) for r in results.values()),
        "seconds": round(time.monotonic() - started, 1),
        "machines": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 1 if report["total_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
