"""Where a decode step's time goes: wall time vs. GPU kernel time, per kernel.

    python -m sparsevllm.bench.profile_step --model-config llama3-8b --prompt-len 8192 \\
        --batch-size 24 --sparse-method quest --decode-keep-tokens 2048 --json prof.json

Prefills a batch of random prompts (dummy weights), then times `--steps` decode steps
(synchronised wall time per step, with the engine's CUDA graphs unless
`--enforce-eager`), then the same number of eager steps, and profiles eager steps with
`torch.profiler`: GPU time per kernel name, per step. Kernels are profiled eagerly so
that every launch is attributed; wall time minus kernel time is host work (and launch
gaps) that the GPU waits for.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from sparsevllm import LLM, SamplingParams
from sparsevllm.bench.model_configs import MODEL_CONFIGS, write_model_config
from sparsevllm.engine import step_loop
from sparsevllm.layers.sampler import SampledTokens

# Early sequences decode while later ones prefill: room for that, so that none finishes
# before the profiled steps.
MAX_TOKENS = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model-config",
        default="llama3-8b",
        choices=sorted(MODEL_CONFIGS),
        help="real model shapes, dummy weights",
    )
    p.add_argument("--prompt-len", type=int, default=8192, help="tokens per prompt")
    p.add_argument("--batch-size", type=int, default=24, help="sequences decoding together")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len (default: just the prompt and the steps; it sizes "
        "per-row tables such as Quest's pages)",
    )
    p.add_argument("--steps", type=int, default=8, help="decode steps timed and profiled")
    p.add_argument("--sparse-method", default="vanilla", help="registered method name")
    p.add_argument("--decode-keep-tokens", type=int, default=None, help="method budget")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA-graph decode")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch the next decode step before the current one's tokens reach the host "
        "(default: the engine's, on with CUDA)",
    )
    p.add_argument("--rows", type=int, default=25, help="kernels shown in the table")
    p.add_argument(
        "--prefill-steps",
        type=int,
        default=0,
        help="also profile 2 x this many prefill steps (host phases, then kernels)",
    )
    p.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="also run N decode steps (as configured) under cProfile: host functions by "
        "own and cumulative time per step",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="JSON file of further engine settings and method knobs (e.g. DeltaKV's "
        "deltakv_checkpoint); the flags above override it",
    )
    p.add_argument("--json", help="write the step times and the kernel table here")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> LLM:
    if args.max_model_len is not None and args.max_model_len < args.prompt_len + MAX_TOKENS:
        raise SystemExit(
            f"--max-model-len must be at least --prompt-len + {MAX_TOKENS} (the requests' "
            f"max_tokens): {args.prompt_len + MAX_TOKENS}"
        )
    kwargs: dict[str, Any] = dict(
        load_format="dummy",
        max_model_len=args.max_model_len or args.prompt_len + MAX_TOKENS,
        max_num_seqs=args.batch_size,
        sparse_method=args.sparse_method,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=False,
    )
    if args.decode_keep_tokens is not None:
        kwargs["decode_keep_tokens"] = args.decode_keep_tokens
    if args.config:
        with open(args.config) as f:
            kwargs = {**json.load(f), **kwargs}
    return LLM(write_model_config(args.model_config), **kwargs)


def start_decoding(llm: LLM, args: argparse.Namespace) -> dict[str, Any] | None:
    """Add the batch and step until every sequence has its first token; with
    `--prefill-steps K`, the first K steps are timed by host phase and the next K
    profiled by kernel (returned)."""
    engine = llm.engine
    vocab = engine.source.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    prefill = None
    if args.prefill_steps:
        k = args.prefill_steps
        phases = host_phases(llm, k)
        table, _ = kernel_table(llm, k)
        kernel_ms = sum(r["gpu_ms_per_step"] for r in table)
        prefill = dict(steps=k, host_phases_ms=phases, kernel_ms=kernel_ms, kernels=table)
        print("prefill host phases, ms per step: " + _fmt(phases))
        print(f"prefill kernels {kernel_ms:.2f} ms of GPU time per step; top:")
        for r in table[: args.rows]:
            print(f"  {r['name'][:76]:<76} {r['gpu_ms_per_step']:8.3f}")
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(not s.output_token_ids for s in running):
        engine.step()
    for _ in range(3):  # the first decode steps build method state (e.g. Quest pages)
        engine.step()
    if len(running) != args.batch_size or any(s.num_preemptions for s in running):
        raise SystemExit(
            f"only {len(running)} of {args.batch_size} sequences decode together (KV pool too "
            "small, or preempted): lower --batch-size or --prompt-len"
        )
    return prefill


def _fmt(phases: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in phases.items())


def timed_steps(llm: LLM, n: int) -> list[float]:
    """Wall time of `n` steps, each since the previous one returned. With overlapped
    scheduling a step returns while the next one runs on the device, so no
    synchronisation between steps (it would serialise host and device again)."""
    sync_each_step = not llm.engine.async_scheduling
    times = []
    torch.cuda.synchronize()
    last = time.perf_counter()
    for _ in range(n):
        llm.engine.step()
        if sync_each_step:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    torch.cuda.synchronize()
    return times


def host_phases(llm: LLM, n: int) -> dict[str, float]:
    """Milliseconds per step in each host phase of `n` steps (as configured: graphs or
    eager). "wait_tokens" is the wait for the sampled tokens (the GPU's step time that
    the host did not overlap); "other" is the rest of the engine's step (outputs, finish
    checks, and the eager forward when no graph runs)."""
    engine, runner = llm.engine, llm.engine.runner
    targets = {
        "schedule": (engine.scheduler, "schedule"),
        "plan": (step_loop, "plan_step"),  # the StepPlan: slot lists, table writes
        "prepare": (runner, "_prepare"),
        "graph_replay": (runner.graphs, "run"),
        "after_step": (runner.method, "after_step"),
        "sample_launch": (runner.sampler, "launch"),
        "wait_tokens": (SampledTokens, "result"),
        # Overlapped scheduling: the step scheduled ahead, then the finished one accounted.
        "schedule_ahead": (engine.scheduler, "schedule_ahead"),
        "complete": (engine.loop, "_complete"),
        "outputs": (engine.loop, "_report"),
    }
    spent = dict.fromkeys(targets, 0.0)
    originals = {}
    for name, (obj, attr) in targets.items():
        if obj is None:
            continue
        original = getattr(obj, attr)
        originals[name] = (original, attr in vars(obj))  # an instance attribute already?

        def timed(*a, _f=original, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(obj, attr, timed)  # an instance attribute shadows the method
    try:
        total = sum(timed_steps(llm, n))
    finally:
        for name, (original, own) in originals.items():
            obj, attr = targets[name]
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
    result = {name: 1e3 * t / n for name, t in spent.items()}
    result["other"] = 1e3 * total / n - sum(result.values())
    return result


def host_functions(llm: LLM, n: int, rows: int) -> list[dict[str, Any]]:
    """The host functions of `n` steps under cProfile: ms per step of own time and of
    cumulative time, the `rows` largest by own time plus the largest cumulative ones."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    timed_steps(llm, n)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    table = [
        dict(
            function=f"{name} ({file.rsplit('/', 2)[-1]}:{line})",
            calls_per_step=nc / n,
            own_ms_per_step=1e3 * tt / n,
            cumulative_ms_per_step=1e3 * ct / n,
        )
        for (file, line, name), (_, nc, tt, ct, _) in stats.items()
    ]
    by_own = sorted(table, key=lambda r: r["own_ms_per_step"], reverse=True)[:rows]
    by_cum = sorted(table, key=lambda r: r["cumulative_ms_per_step"], reverse=True)[:rows]
    return by_own + [r for r in by_cum if r not in by_own]


def kernel_table(llm: LLM, n: int) -> tuple[list[dict[str, Any]], str]:
    """GPU time per kernel name and step, from `n` profiled steps."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            llm.engine.step()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.time_range.elapsed_us()
    table = [
        dict(name=name, calls_per_step=c / n, gpu_ms_per_step=us / 1e3 / n)
        for name, (c, us) in per_name.items()
    ]
    table.sort(key=lambda r: r["gpu_ms_per_step"], reverse=True)
    return table, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    llm = build(args)
    args.async_scheduling = llm.engine.async_scheduling  # as resolved (unset: on)
    prefill = start_decoding(llm, args)
    step_ms = statistics.median(timed_steps(llm, args.steps)) * 1e3
    phases = host_phases(llm, args.steps)
    functions = host_functions(llm, args.cprofile, args.rows) if args.cprofile else []
    if functions:
        print(f"{'host function (cProfile)':<70} {'calls':>7} {'own ms':>7} {'cum ms':>7}")
        for r in functions:
            print(
                f"{r['function'][:70]:<70} {r['calls_per_step']:7.0f} "
                f"{r['own_ms_per_step']:7.2f} {r['cumulative_ms_per_step']:7.2f}"
            )
    llm.engine.runner.graphs = None  # the runner replays graphs only when it has them
    eager_ms = statistics.median(timed_steps(llm, args.steps)) * 1e3
    table, cpu_text = kernel_table(llm, args.steps)
    print(cpu_text)
    print(f"{'kernel':<80} {'calls':>6} {'ms/step':>8}")
    for r in table[: args.rows]:
        print(f"{r['name'][:80]:<80} {r['calls_per_step']:6.0f} {r['gpu_ms_per_step']:8.3f}")
    kernel_ms = sum(r["gpu_ms_per_step"] for r in table)
    print("host phases, ms per step: " + _fmt(phases))
    print(
        f"{args.sparse_method} b{args.batch_size} x {args.prompt_len}: step {step_ms:.2f} ms "
        f"({'eager' if args.enforce_eager else 'graphs'}), eager {eager_ms:.2f} ms, "
        f"kernels {kernel_ms:.2f} ms of GPU time per step"
    )
    if args.json:
        result = dict(
            args=vars(args),
            step_ms=step_ms,
            eager_step_ms=eager_ms,
            kernel_ms=kernel_ms,
            host_phases_ms=phases,
            host_functions=functions,
            prefill=prefill,
        )
        with open(args.json, "w") as f:
            json.dump({**result, "kernels": table}, f, indent=2)


if __name__ == "__main__":
    main()
