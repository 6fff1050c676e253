"""The default CLI's decode speed with one core kept busy by another process (issue 23).

Runs `sparsevllm generate` (the default model, a chat prompt, 128 greedy tokens,
`ignore_eos`, `--json`) as a user would, in four settings:

- idle, `--cpu-threads 1` (the reference of the bar: at least 0.8x of it when contended);
- idle, default threads;
- one core kept busy by a spinning process pinned to it, default threads;
- the same, with `--cpu-threads` set to every core (torch's own default, the collapse).

    python scripts/cpu_contention.py --json docs/benchmarks/cpu/contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SPIN = "import os, time\nos.sched_setaffinity(0, {%d})\nwhile True: pass\n"


def generate(threads: int | None, repeats: int) -> dict[str, float]:
    cmd = [
        sys.executable,
        "-m",
        "sparsevllm.cli",
        "generate",
        "--chat",
        "Write a short story about a lighthouse keeper.",
        "--max-tokens",
        "128",
        "--ignore-eos",
        "--temperature",
        "0",
        "--json",
        "--no-progress",
    ]
    if threads is not None:
        cmd += ["--cpu-threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    runs = []
    for _ in range(repeats):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        runs.append(json.loads(out)["summary"])
    best = max(runs, key=lambda s: s["decode_tokens_per_s"])
    return {
        "decode_tokens_per_s": best["decode_tokens_per_s"],
        "cpu_threads": best["cpu_threads"],
        "dtype": best["dtype"],
        "runs": [r["decode_tokens_per_s"] for r in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="Runs per setting (best kept).")
    p.add_argument("--json", help="Write the report here.")
    args = p.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    report: dict[str, object] = {"cores": cores}
    report["idle_1_thread"] = generate(1, args.repeats)
    report["idle_default"] = generate(None, args.repeats)
    spinner = subprocess.Popen([sys.executable, "-c", SPIN % cores[-1]])
    try:
        time.sleep(1.0)
        report["busy_default"] = generate(None, args.repeats)
        report["busy_all_cores"] = generate(len(cores), args.repeats)
    finally:
        spinner.kill()
        spinner.wait()
    ref = report["idle_1_thread"]["decode_tokens_per_s"]  # type: ignore[index]
    report["busy_default_over_idle_1_thread"] = (
        report["busy_default"]["decode_tokens_per_s"] / ref  # type: ignore[index]
    )
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
