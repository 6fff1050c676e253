"""Decode-capacity mode of `sparsevllm bench throughput` (`--decode-capacity SEEDS`).

What the benchmark times is decode at a batch, and the batch that matters most is the
largest one a method admits: hundreds of sequences for SnapKV or INT4 KV at 32K-token
prompts. Prefilling hundreds of 32K prompts takes far longer than the decode steps, and
longer than a device session allows. In this mode phase 1 prefills only SEEDS distinct
prompts; the batch is then filled with copies of their post-prefill state
(`LLMEngine.clone_cached`): each copy in KV slots of its own, its rows copied on the
device in the stored form (quantized codes, scales, KIVI key groups), and under the
chain cache its sequence's state (view positions, the method's per-sequence state).
Phase 2 then resends every seed and every copy and decodes the whole batch exactly as
a full run does (`throughput.run_engine`: the same step loop, the same timing).

Real: the decode steps, the KV memory every sequence holds and reads per step (copies
never share a slot: reads of identical addresses from many sequences would be served
from the L2 cache and flatter the step time), admission of the batch. Synthetic: a
copy's KV is its seed's; under the radix cache it is cached under other tokens (the
seed's with the first one replaced), so it is the KV of other tokens; a method that
selects by content (Quest's pages, OmniKV's tokens) picks the same positions in every
copy of a seed. An end-to-end run at a batch that can be prefilled validates the mode.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sparsevllm.engine.engine import LLMEngine
from sparsevllm.engine.kv_pool import PoolExhausted
from sparsevllm.llm import LLM
from sparsevllm.outputs import RequestOutput


@dataclass(frozen=True)
class Resend:
    """A phase-2 request: prompt + first token (a seed) or a copy's tokens + its seed's
    first token, the chain it continues (chain cache), and the seed whose state it holds."""

    tokens: list[int]
    chain_id: str | None
    seed: int


def add_capacity_argument(p: argparse.ArgumentParser) -> None:
    """`--decode-capacity [SEEDS]` on the `bench throughput` parser."""
    p.add_argument(
        "--decode-capacity",
        metavar="SEEDS",
        type=int,
        nargs="?",
        const=1,
        default=None,
        help="Decode-capacity mode: prefill only SEEDS distinct prompts (1 if no number is "
        "given) and fill the batch with copies of their post-prefill KV state, each in KV "
        "slots of its own (rows copied on the device in the stored form), then decode the "
        "whole batch and time it as usual. Measures decode at batches too large to prefill "
        "in time; the copies' KV is synthetic (see docs/benchmarks/README.md). Not with "
        "--compare.",
    )


def check_batch(llm: LLM, batch: int, seeds: int, largest: int) -> None:
    """Refuse, naming the numbers, a decode-capacity run that could not decode its whole
    batch at once: `largest` is the largest batch whose decode-time KV fits the pool
    (`throughput.max_batch`, also bounded by max_num_seqs)."""
    if seeds < 1:
        raise SystemExit(f"--decode-capacity needs at least one prompt to prefill, got {seeds}")
    if seeds > batch:
        raise SystemExit(
            f"--decode-capacity {seeds} prefills more prompts than the batch of {batch}: "
            "lower it or raise --batch-size"
        )
    engine = llm.engine
    if engine.store is None:
        raise SystemExit(
            "--decode-capacity copies cached post-prefill state, which needs prefix caching "
            "(drop --no-enable-prefix-caching)"
        )
    if batch > largest:
        raise SystemExit(
            f"--decode-capacity decodes the whole batch at once, but a batch of {batch} "
            f"exceeds the largest that fits ({largest}: the pool holds {engine.pool.num_slots} "
            f"KV slots per layer, max_num_seqs is {engine.capacity.max_num_seqs}); lower "
            "--batch-size or drop it (the default is the largest batch)"
        )


def copy_counts(batch: int, seeds: int) -> list[int]:
    """How many copies of each seed fill a batch (as even as can be, the first seeds
    taking one more)."""
    share, extra = divmod(batch - seeds, seeds)
    return [share + (i < extra) for i in range(seeds)]


def fill_batch(
    engine: LLMEngine, prompts: list[list[int]], firsts: list[RequestOutput], batch: int
) -> list[Resend]:
    """Copy the seeds' cached post-prefill state up to `batch` sequences in all; the
    phase-2 requests of the copies (the seeds' own are the caller's)."""
    out: list[Resend] = []
    for seed, (prompt, first, n) in enumerate(
        zip(prompts, firsts, copy_counts(batch, len(prompts)))
    ):
        try:
            copies = engine.clone_cached(first.chain_id, prompt, count=n)
        except PoolExhausted as e:
            raise SystemExit(f"--decode-capacity: {e}") from e
        out += [Resend(c.tokens + first.token_ids, c.chain_id, seed) for c in copies]
    return out


def report_fields(copy_s: float | None, prefilled: int, batch: int) -> dict[str, Any]:
    """The report's account of the mode: whether it was used, how many prompts were
    really prefilled, how many sequences were copies, and the time the copies took
    (outside both timed phases)."""
    return {
        "decode_capacity": copy_s is not None,
        "prefilled_prompts": prefilled,
        "copied_sequences": batch - prefilled,
        "copy_s": copy_s,
    }
