"""`sparsevllm bench throughput`: prefill/decode throughput against the memory roofline.

Requests of `--prompt-len` random tokens are submitted at once and the engine is
stepped by hand, so prefill steps and pure-decode steps are timed separately. The
decode roofline of a step is (weight bytes + the KV bytes the step reads) divided by the
device's copy bandwidth, measured in the same run. The KV read is counted by the engine
(`measure_kv_reads`, engine/kv_reads.py): every sequence's view in every layer, less
what a method's decode selection skips; the bytes resident in the pool (prefixes cached
for later requests included) are reported beside it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from sparsevllm.bench.capacity import (
    Resend,
    check_batch,
    fill_batch,
    report_fields,
)
from sparsevllm.bench.model_configs import write_model_config
from sparsevllm.bench.roofline import measure_copy_bandwidth, moe_report, weight_bytes_per_step
from sparsevllm.engine.cpu_compile import CompiledForward
from sparsevllm.engine.kv_pool import shuffle_seed
from sparsevllm.llm import LLM
from sparsevllm.sampling import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(engine, device: torch.device) -> tuple[list, float, list[float], list[int]]:
    """Step until idle; time every step that computed no prefill token.

    A step's time is the wall time since the previous step returned. Without overlapped
    scheduling the device is synchronised after every step; with it, a step returns as
    soon as the tokens of the step before are on the host while the next one already
    runs, so a synchronisation here would serialise host and device again: the time
    between returns is then the steady-state step period."""
    sync_each_step = not engine.async_scheduling
    decode_times: list[float] = []
    kv_layer_slots: list[int] = []  # resident slots summed over layers, per decode step
    outputs = []
    _sync(device)
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        before = engine.scheduler.stats.num_prefill_tokens_computed
        outputs += [o for o in engine.step(partial_outputs=False) if o.finished]
        if sync_each_step:
            _sync(device)
        now = time.perf_counter()
        if engine.scheduler.stats.num_prefill_tokens_computed == before:
            decode_times.append(now - last)
            kv_layer_slots.append(sum(engine.pool.used_per_layer()))
        last = now
    _sync(device)
    return outputs, time.perf_counter() - start, decode_times, kv_layer_slots


def run_engine(
    llm: LLM, prompts: list[list[int]], output_len: int, batch: int | None = None
) -> dict[str, Any]:
    """Two phases, so every request decodes in one batch.

    Phase 1 prefills every prompt and samples its first token. Phase 2 sends each
    prompt plus that token again: the cross-request state (radix prefix cache or chain
    cache) restores the KV, the new token is computed, and all requests decode together
    for the remaining tokens. Without the phases, requests that finish prefill early
    would be done before the last prefill ends, and no step would decode the full batch.

    With `batch` (decode-capacity mode, bench/capacity.py) the prompts are seeds: between
    the phases their cached state is copied up to `batch` sequences, and phase 2 resends
    the copies too. `completions` holds each phase-2 request's tokens (the first one
    included), `seeds` the prompt whose state it holds.
    """
    engine = llm.engine
    device = engine.runner.device
    engine.pool.reset_peak()
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = [engine.add_request(p, first) for p in prompts]
    outs, prefill_s, _, _ = _drain(engine, device)
    scoring = engine.runner.scoring.cost.as_dict()  # phase 1's scoring passes (KVzip)
    by_id = {o.request_id: o for o in outs}
    firsts = [by_id[rid] for rid in ids]
    resends = [
        Resend(p + o.token_ids, o.chain_id, i) for i, (p, o) in enumerate(zip(prompts, firsts))
    ]
    copy_s = None
    if batch is not None:
        _sync(device)
        start = time.perf_counter()
        resends += fill_batch(engine, prompts, firsts, batch)
        _sync(device)
        copy_s = time.perf_counter() - start
    rest = SamplingParams(temperature=0.0, max_tokens=max(1, output_len - 1), ignore_eos=True)
    rids = [engine.add_request(r.tokens, rest, chain_id=r.chain_id) for r in resends]
    meter = engine.runner.kv_reads
    if meter is not None:
        meter.reset()
    finals, decode_s, decode_times, kv = _drain(engine, device)
    done = {o.request_id: o for o in finals}
    return {
        "total_s": prefill_s + decode_s,
        "prefill_s": prefill_s,
        "copy_s": copy_s,
        "decode_step_times": decode_times,
        "kv_layer_slots": kv,
        # Slots the decode steps read, per step and summed over layers (None: not measured).
        "kv_read_slots": meter.slots_read() / meter.steps if meter and meter.steps else None,
        "ttft": [o.metrics["time_to_first_token"] for o in outs],
        "cached_tokens": sum(o.num_cached_tokens for o in finals),
        "scoring": scoring,
        "completions": [
            firsts[r.seed].token_ids + done[rid].token_ids for r, rid in zip(resends, rids)
        ],
        "seeds": [r.seed for r in resends],
    }


def scoring_report(
    cost: dict[str, float], prefill_s: float, prompt_tokens: int
) -> dict[str, float | None] | None:
    """A method's scoring passes in the prefill phase (KVzip's context reconstruction;
    None for methods without): their counts, and their cost as a ratio of a plain
    prefill, the phase's time without them (the passes run synchronised, timed apart)."""
    if not cost["scoring_passes"]:
        return None
    plain = prefill_s - cost["scoring_seconds"]
    return {
        **cost,
        "tokens_per_prompt_token": cost["scoring_tokens"] / prompt_tokens,
        "time_over_plain_prefill": cost["scoring_seconds"] / plain if plain > 0 else None,
    }


def build_llm(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> LLM:
    """The engine under test (dummy weights for --model-config), warmed up."""
    model = engine_kwargs.pop("model", None)
    if args.model_config:
        model = write_model_config(args.model_config)
        engine_kwargs.setdefault("load_format", "dummy")
    engine_kwargs["measure_kv_reads"] = True  # the roofline's KV bytes: always counted here
    args._model_dir = model if model and os.path.isdir(model) else None  # for kvpress
    args._model_name = args.model_config or model
    llm = LLM(model, **engine_kwargs)
    args._llm = llm  # reused by --compare to copy the same weights
    vocab = llm.engine.source.hf_config.vocab_size
    rng = random.Random(args.seed)
    warm = [[rng.randrange(vocab) for _ in range(64)]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    return llm


def bench(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    llm = build_llm(args, engine_kwargs)
    bandwidth = measure_copy_bandwidth(llm.engine.runner.device)
    return measure(args, llm, args.prompt_len, bandwidth)


def measure(
    args: argparse.Namespace, llm: LLM, prompt_len: int, bandwidth: float
) -> dict[str, Any]:
    """One point: a batch of random `prompt_len`-token prompts through the engine (with
    --decode-capacity: a few of them, and copies of their state up to the batch)."""
    engine = llm.engine
    vocab = engine.source.hf_config.vocab_size
    largest = max_batch(llm, prompt_len, args.output_len)
    batch = args.batch_size or largest
    seeds = args.decode_capacity
    if seeds is not None:
        check_batch(llm, batch, seeds, largest)
    # Seeded per length: a sweep's prompts never share a cached prefix across points.
    rng = random.Random(args.seed * 1_000_003 + prompt_len)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(seeds or batch)]
    engine.reset_counters()
    run = run_engine(llm, prompts, args.output_len, batch if seeds is not None else None)
    return report(args, llm, run, prompt_len, batch, len(prompts), bandwidth)


def report(
    args: argparse.Namespace,
    llm: LLM,
    run: dict[str, Any],
    prompt_len: int,
    batch: int,
    prefilled: int,
    bandwidth: float,
) -> dict[str, Any]:
    """The report of one `run_engine` run of `batch` requests, `prefilled` of which were
    prefilled (fewer in decode-capacity mode: prefill rates are over those, and the
    end-to-end rate of a batch that was not all prefilled is not reported)."""
    engine, runner = llm.engine, llm.engine.runner
    steps = run["decode_step_times"][1:] or run["decode_step_times"]  # first one warms up
    step = statistics.median(steps) if steps else float("nan")
    per_layer_bytes = runner.kv_bytes_per_slot // runner.num_layers
    kv_resident = statistics.median(run["kv_layer_slots"]) * per_layer_bytes if steps else 0
    # The roofline counts what the steps read (whole views or a method's selection), not
    # what is resident (cached prefixes of finished requests, skipped tokens).
    read = run["kv_read_slots"]
    kv_read = read * per_layer_bytes if read is not None else kv_resident
    weights = weight_bytes_per_step(runner.model, batch)
    roofline = (weights + kv_read) / bandwidth
    ttft = run["ttft"]
    stats = llm.stats()
    end_to_end = batch * args.output_len / run["total_s"] if run["copy_s"] is None else None
    return {
        "model": args._model_name,
        "dtype": str(runner.dtype).replace("torch.", ""),
        "kv_cache_dtype": runner.kv_format.name,
        "kv_bytes_per_slot": runner.kv_bytes_per_slot,
        "device": torch.cuda.get_device_name(runner.device)
        if runner.device.type == "cuda"
        else "cpu",
        "cpu_threads": torch.get_num_threads() if runner.device.type == "cpu" else None,
        "sparse_method": llm.config.sparse_method,
        "knobs": runner.method.knob_values(),
        "prefill_policy": engine.prefill_policy,
        "bounded_prefill": llm.config.bounded_prefill,
        "chunk_prefill_size": llm.config.chunk_prefill_size,
        "cuda_graphs": runner.graphs is not None,
        "cpu_compiled": isinstance(runner.model, CompiledForward),
        "async_scheduling": engine.async_scheduling,
        "kv_slots_shuffled": shuffle_seed(llm.config.kv_slot_order, llm.config.seed) is not None,
        "prompt_len": prompt_len,
        "output_len": args.output_len,
        "batch_size": batch,
        **report_fields(run["copy_s"], prefilled, batch),
        "concurrency": stats["max_concurrent_seqs"],
        "prefill_tokens_per_s": prefilled * prompt_len / run["prefill_s"],
        "scoring_pass": scoring_report(run["scoring"], run["prefill_s"], prefilled * prompt_len),
        "decode_tokens_per_s": batch / step if steps else None,
        "end_to_end_tokens_per_s": end_to_end,
        "time_to_first_token_s": {"mean": statistics.mean(ttft), "max": max(ttft)},
        "time_per_output_token_s": step,
        "peak_kv_slots": stats["kv_slots_peak"],
        "peak_kv_bytes": stats["kv_slots_peak"] * runner.kv_bytes_per_slot,
        "kv_slots_total": stats["kv_slots_total"],
        "num_preemptions": stats["num_preemptions"],
        "device_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": weights,
        "moe": moe_report(runner.model, batch),
        "kv_bytes_resident_per_step": kv_resident,
        "kv_bytes_read_per_step": kv_read,
        "kv_reads_measured": read is not None,
        "roofline_step_s": roofline,
        "roofline_fraction": roofline / step if steps else None,
        "total_s": run["total_s"],
        "decode_phase_cached_tokens": run["cached_tokens"],
        "decode_steps_timed": len(steps),
    }


def max_batch(llm: LLM, prompt_len: int, output_len: int) -> int:
    """The largest batch whose decode-time residency fits the pool at once (prefill
    peaks are transient: admission staggers them)."""
    per_seq = llm.engine.method.decode_resident(prompt_len, output_len) + 1
    return max(1, min(llm.engine.pool.num_slots // per_seq, llm.config.max_num_seqs))
