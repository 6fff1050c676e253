"""Load and soak: N concurrent streaming clients against a server on 127.0.0.1 (the tests'
tiny random Llama, radix prefix cache on) for a fixed time.

    PYTHONPATH=src:tests python scripts/soak.py --clients 256 --duration 600 \
        --json docs/reliability/soak.json

The server runs in its own process (`sparsevllm serve`), so its memory is its own. Each
client loops until the deadline: a greedy streamed completion (ignore_eos, logprobs 0,
usage included) of one of a fixed set of prompts, each with its own max_tokens. Checked
for every request: the tokens streamed (counted through their logprobs entries) equal
usage.completion_tokens equal max_tokens (no token lost or sent twice), and the text
equals the non-streamed greedy answer taken before the load. Reported: requests, tokens,
mismatches, latency percentiles (whole request and first token), the server's RSS
sampled through the run, and the KV slots once idle against the cached baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import httpx  # noqa: E402
import psutil  # noqa: E402

from conftest import _make  # noqa: E402
from sparsevllm.server.metrics import parse_metrics  # noqa: E402

NUM_PROMPTS = 48


def prompts() -> list[tuple[str, int]]:
    """(prompt, max_tokens): shared beginnings, so the prefix cache is exercised."""
    rng = random.Random(0)
    heads = [" ".join(f"w{rng.randrange(7, 250)}" for _ in range(24)) for _ in range(6)]
    out = []
    for i in range(NUM_PROMPTS):
        tail = " ".join(f"w{rng.randrange(7, 250)}" for _ in range(rng.randrange(1, 40)))
        out.append((f"{heads[i % len(heads)]} {tail}", 8 + i % 25))
    return out


@dataclass
class Totals:
    requests: int = 0
    tokens: int = 0
    lost_or_duplicated: int = 0  # streamed tokens != usage != max_tokens
    text_mismatches: int = 0  # streamed text != the non-streamed greedy answer
    errors: list[str] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)


def start_server(model: str, port: int, max_num_seqs: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "sparsevllm.cli", "serve", model,
        "--port", str(port), "--served-model-name", "tiny",
        "--max-model-len", "256", "--num-kv-slots", "32768",
        "--max-num-seqs", str(max_num_seqs), "--max-queue-len", "512",
        "--enable-prefix-caching", "--server-log-level", "warning", "--dtype", "float32",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    if stream:
        b |= {"stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    return b


async def one_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    first = None
    text, tokens, usage = [], 0, None
    async with client.stream("POST", "/v1/completions", json=body(prompt, max_tokens, True)) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": json.dumps(chunk)[:200]}
            for choice in chunk["choices"]:
                if first is None and choice["text"]:
                    first = time.perf_counter() - started
                text.append(choice["text"])
                tokens += len((choice.get("logprobs") or {}).get("tokens") or [])
            usage = chunk.get("usage") or usage
    return {
        "text": "".join(text),
        "tokens": tokens,
        "usage": usage["completion_tokens"] if usage else None,
        "latency": time.perf_counter() - started,
        "first_token": first,
    }


async def client_loop(
    url: str, cases: list[tuple[str, int]], refs: list[str], deadline: float, totals: Totals
) -> None:
    rng = random.Random()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < deadline:
            i = rng.randrange(len(cases))
            prompt, max_tokens = cases[i]
            try:
                got = await one_stream(client, prompt, max_tokens)
            except httpx.HTTPError as e:
                got = {"error": repr(e)}
            totals.requests += 1
            if "error" in got:
                totals.errors.append(got["error"])
                continue
            totals.tokens += got["tokens"]
            if not got["tokens"] == got["usage"] == max_tokens:
                totals.lost_or_duplicated += 1
            if got["text"] != refs[i]:
                totals.text_mismatches += 1
            totals.latency.append(got["latency"])
            if got["first_token"] is not None:
                totals.first_token.append(got["first_token"])


def sample_rss(pid: int, samples: list[tuple[float, float]], stop: asyncio.Event) -> Any:
    proc = psutil.Process(pid)

    async def loop() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            samples.append((round(time.monotonic() - t0, 1), proc.memory_info().rss / 2**20))
            try:
                await asyncio.wait_for(stop.wait(), timeout=5)
            except asyncio.TimeoutError:
                pass

    return loop()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def memory_report(samples: list[tuple[float, float]]) -> dict[str, Any]:
    """RSS over the run; 'flat' compares the last quarter with the second quarter (after
    warm-up: allocator pools and caches fill early)."""
    rss = [m for _, m in samples]
    q = max(1, len(rss) // 4)
    early, late = statistics.mean(rss[q : 2 * q] or rss), statistics.mean(rss[-q:])
    return {
        "rss_mib_first": round(rss[0], 1),
        "rss_mib_max": round(max(rss), 1),
        "rss_mib_last": round(rss[-1], 1),
        "rss_mib_second_quarter_mean": round(early, 1),
        "rss_mib_last_quarter_mean": round(late, 1),
        "growth_after_warmup_pct": round(100 * (late - early) / early, 2),
        "samples_every_s": 5,
        "samples": [[t, round(m, 1)] for t, m in samples],
    }


async def soak(url: str, pid: int, clients: int, duration: float) -> dict[str, Any]:
    cases = prompts()
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        refs = []
        for prompt, max_tokens in cases:  # the greedy answers, one at a time
            r = await c.post("/v1/completions", json=body(prompt, max_tokens, False))
            r.raise_for_status()
            refs.append(r.json()["choices"][0]["text"])
    baseline = metrics(url)
    totals, samples, stop = Totals(), [], asyncio.Event()
    sampler = asyncio.ensure_future(sample_rss(pid, samples, stop))
    started = time.monotonic()
    deadline = started + duration
    await asyncio.gather(*(client_loop(url, cases, refs, deadline, totals) for _ in range(clients)))
    elapsed = time.monotonic() - started
    stop.set()
    await sampler
    return {
        "totals": totals,
        "elapsed": elapsed,
        "memory": memory_report(samples),
        "baseline": baseline,
    }


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = m["sparsevllm:num_requests_running"] + m["sparsevllm:num_requests_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            return m


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    model = _make("llama", Path(tempfile.mkdtemp(prefix="soak-model-")))
    url = f"http://127.0.0.1:{args.port}"
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    proc = start_server(model, args.port, args.max_num_seqs, log)
    try:
        wait_ready(url, proc)
        result = asyncio.run(soak(url, proc.pid, args.clients, args.duration))
        idle = wait_idle(url)
        cache = httpx.get(url + "/v1/cache", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(60)
    t: Totals = result["totals"]
    used, cached = idle["sparsevllm:kv_slots_used"], idle.get("sparsevllm:kv_slots_cached", 0)
    report = {
        "command": " ".join(sys.argv),
        "clients": args.clients,
        "duration_s": round(result["elapsed"], 1),
        "requests": t.requests,
        "tokens_streamed": t.tokens,
        "lost_or_duplicated_token_requests": t.lost_or_duplicated,
        "text_mismatches_vs_greedy_reference": t.text_mismatches,
        "errors": len(t.errors),
        "error_examples": t.errors[:5],
        "latency_s": {
            "p50": percentile(t.latency, 0.50),
            "p90": percentile(t.latency, 0.90),
            "p99": percentile(t.latency, 0.99),
            "max": percentile(t.latency, 1.0),
        },
        "first_token_s": {
            "p50": percentile(t.first_token, 0.50),
            "p99": percentile(t.first_token, 0.99),
        },
        "tokens_per_s": round(t.tokens / result["elapsed"], 1),
        "kv_slots_after": {
            "used": used,
            "cached": cached,
            "held_by_requests": used - cached,
            "cache_listing_slots": cache.get("kv_slots_cached"),
            "before_load_used": result["baseline"]["sparsevllm:kv_slots_used"],
        },
        "memory": result["memory"],
        "server_exit_status": proc.returncode,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    ok = t.requests and not (t.lost_or_duplicated or t.errors) and used == cached
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
