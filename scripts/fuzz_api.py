"""The long run of the schema-driven API fuzzer (tests/api_fuzz.py) against real servers
on 127.0.0.1 with the tests' tiny random Llama: one with the radix prefix cache, one
with the chain cache (knorm), both behind an API key.

    PYTHONPATH=src:tests python scripts/fuzz_api.py --examples 150 \
        --json docs/reliability/fuzz_api.json

Every operation of the OpenAPI document gets `--examples` generated requests in each
mode (valid, schema-breaking). Prints (and writes) JSON: requests tried per status and
operation, failures (5xx, undocumented statuses or content types, answers that break
the documented schema, errors not in OpenAI's shape), and whether each server still
gave the same greedy answer afterwards. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import httpx  # noqa: E402

from api_fuzz import fuzz  # noqa: E402
from conftest import _make  # noqa: E402
from server.conftest import RunningServer, start_server, tiny_config  # noqa: E402

KEY = "sk-fuzz"
GREEDY = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0.0}
SERVERS: dict[str, dict[str, Any]] = {
    "radix": {"enable_prefix_caching": True},
    "chain": {"enable_prefix_caching": True, "sparse_method": "knorm"},
}


def greedy(server: RunningServer) -> str:
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/completions", json=GREEDY, headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def fuzz_one(model: str, overrides: dict[str, Any], examples: int, seed: bool) -> dict[str, Any]:
    config = tiny_config(model, max_model_len=48, **overrides)
    server = start_server(config, served_model_name="tiny", api_key=KEY, max_queue_len=16)
    try:
        before = greedy(server)
        started = time.monotonic()
        report = fuzz(server.url, examples, api_key=KEY, derandomize=seed)
        seconds = time.monotonic() - started
        idle = server.wait_idle(60)
        after = greedy(server)
        alive = httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()
    return {
        **report.as_dict(),
        "seconds": round(seconds, 1),
        "same_greedy_answer_after": before == after,
        "alive_after": alive,
        "idle_after": idle["sparsevllm:num_requests_running"] == 0
        and idle["sparsevllm:kv_slots_used"] == idle.get("sparsevllm:kv_slots_cached", 0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=150, help="per operation and mode")
    parser.add_argument("--random", action="store_true", help="not derandomized")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    model = _make("llama", Path(tempfile.mkdtemp(prefix="fuzz-model-")))
    results = {
        name: fuzz_one(model, overrides, args.examples, not args.random)
        for name, overrides in SERVERS.items()
    }
    report = {
        "command": " ".join(sys.argv),
        "requests": sum(r["requests"] for r in results.values()),
        "server_errors_5xx": sum(r["server_errors_5xx"] for r in results.values()),
        "failures": sum(r["failures"] for r in results.values()),
        "servers": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    ok = all(r["same_greedy_answer_after"] and r["alive_after"] for r in results.values())
    return 0 if ok and not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
