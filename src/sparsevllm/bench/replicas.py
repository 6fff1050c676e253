"""`sparsevllm bench replicas`: multi-turn chats over engine replicas on Ray Serve,
affinity routing against random routing.

N conversations, C at a time, run T turns each through the HTTP ingress of a local
Ray Serve deployment (`--replicas` engines); every turn resends the whole history (chat
completions, no chain id, so only prefix affinity keeps a conversation on its replica).
Per routing mode it reports the cached share of prompt tokens (usage's cached_tokens,
the prefix cache's hits), how often a turn landed on the previous turn's replica, and
the end-to-end time. Writes JSON and a PNG (docs/benchmarks/cpu/replicas.md).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

MODES = ("affinity", "random")
_WORDS = (
    "the of and to in is that for it as with was on be by at this from or have an they "
    "which one you were all we can her has there been if more when will would who so no "
    "file line value error result table query server request model token cache route"
).split()


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replicas",
        help="Multi-turn chats over Ray Serve replicas: affinity vs random routing.",
        description="Conversations over N engine replicas on a local Ray Serve deployment, "
        "routed by prefix affinity or at random; reports the cached-token ratio and the "
        "end-to-end time (needs the replicas extra: pip install 'sparsevllm[replicas]').",
    )
    p.add_argument("--model", default=None, help="Model (default: the bundled SmolLM2).")
    p.add_argument("--replicas", type=int, default=2, help="Engine replicas (default: 2).")
    p.add_argument(
        "--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica (default: 1)."
    )
    p.add_argument(
        "--conversations", type=int, default=8, help="Conversations in all (default: 8)."
    )
    p.add_argument(
        "--concurrency", type=int, default=4, help="Conversations at a time (default: 4)."
    )
    p.add_argument("--turns", type=int, default=4, help="Turns per conversation (default: 4).")
    p.add_argument(
        "--words-per-turn",
        type=int,
        default=120,
        help="Words of each user message (a tool output, say) (default: 120).",
    )
    p.add_argument(
        "--output-len", type=int, default=16, help="Answer tokens per turn (default: 16)."
    )
    p.add_argument(
        "--max-model-len", type=int, default=4096, help="Engine max_model_len (default: 4096)."
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="Routing modes to run (default: affinity random).",
    )
    p.add_argument("--bench-seed", dest="seed", type=int, default=0, help="Seed of the texts.")
    p.add_argument("--output", "-o", help="Write the JSON report here (default: stdout).")
    p.add_argument("--plot", help="Write a PNG of the comparison here.")
    p.set_defaults(func=run_cli)


def _message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _conversation(
    url: str, model: str, index: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One conversation's turns: prompt and cached tokens, replica, seconds."""
    import httpx

    rng = random.Random(args.seed * 100_003 + index)
    messages: list[dict[str, str]] = []
    turns = []
    with httpx.Client(timeout=600) as client:
        for _ in range(args.turns):
            messages.append({"role": "user", "content": _message(rng, args.words_per_turn)})
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": args.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            start = time.perf_counter()
            response = client.post(url + "/v1/chat/completions", json=body)
            response.raise_for_status()
            data = response.json()
            messages.append(
                {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
            )
            usage = data["usage"]
            turns.append(
                {
                    "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                    "replica": response.headers["x-sparsevllm-replica"],
                    "seconds": time.perf_counter() - start,
                }
            )
    return turns


def run_mode(
    mode: str, args: argparse.Namespace, resources: dict[str, float], port: int
) -> dict[str, Any]:
    """Deploy the replicas with `mode` routing on `port` (Serve's HTTP port is set once
    per Ray instance), run every conversation, undeploy."""
    from sparsevllm.config import EngineConfig
    from sparsevllm.server.launcher import default_served_model_name
    from sparsevllm.server.replicas.launcher import deploy, undeploy
    from sparsevllm.server.replicas.options import ReplicaOptions, RouteOptions, ServerOptions

    config = EngineConfig.from_dict(
        {"model": args.model, "max_model_len": args.max_model_len, "device": "cpu",
         "cpu_threads": max(1, int(args.replica_cpus))}
    )  # fmt: skip
    name = default_served_model_name(config)
    options = ReplicaOptions(
        engine=config,
        server=ServerOptions(name, port=port),
        replicas=args.replicas,
        replica_cpus=args.replica_cpus,
        route=RouteOptions(random=mode == "random"),
    )
    deploy(options, resources)
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = [
            pool.submit(_conversation, url, name, i, args) for i in range(args.conversations)
        ]
        convs = [f.result() for f in tqdm(futures, desc=f"{mode} conversations")]
    elapsed = time.perf_counter() - start
    undeploy(options)
    return summarize(mode, convs, elapsed)


def summarize(mode: str, convs: list[list[dict[str, Any]]], elapsed: float) -> dict[str, Any]:
    """A mode's totals over every turn after the first (the first has no history)."""
    later = [t for turns in convs for t in turns[1:]]
    stays = [b["replica"] == a["replica"] for turns in convs for a, b in zip(turns, turns[1:])]
    prompt = sum(t["prompt_tokens"] for t in later)
    cached = sum(t["cached_tokens"] for t in later)
    return {
        "mode": mode,
        "e2e_s": round(elapsed, 2),
        "prompt_tokens_after_turn_1": prompt,
        "cached_tokens_after_turn_1": cached,
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "same_replica_ratio": round(sum(stays) / len(stays), 4) if stays else 0.0,
        "mean_turn_s": round(sum(t["seconds"] for t in later) / len(later), 3) if later else 0.0,
        "replicas_used": sorted({t["replica"] for turns in convs for t in turns}),
    }


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    modes = [r["mode"] for r in results]
    colours = ["tab:blue", "tab:orange"][: len(modes)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    panels = [
        ("cached_ratio", "cached share of prompt tokens\n(turns 2+)"),
        ("same_replica_ratio", "turns on the previous\nturn's replica"),
        ("e2e_s", "end-to-end time (s)"),
    ]
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] for r in results]
        ax.bar(modes, values, color=colours)
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:g}", ha="center", va="bottom", fontsize=9)
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['replicas']} replicas, {cfg['conversations']} conversations x {cfg['turns']} "
        f"turns (CPU, {cfg['model']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_cli(args: argparse.Namespace) -> int:
    from sparsevllm.server.replicas.launcher import connect, shutdown

    for name in ("replicas", "conversations", "concurrency", "turns", "words_per_turn"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    resources = connect(None, num_cpus=max(1.0, args.replicas * args.replica_cpus))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        results = [run_mode(mode, args, resources, port) for mode in args.modes]
    finally:
        shutdown()
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["model"] = args.model or "SmolLM2-135M-Instruct (bundled)"
    report = {"benchmark": "replicas", "config": config, "results": results}
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        plot(report, args.plot)
    return 0
