"""`bench throughput --decode-capacity`: a few prompts prefilled, the batch filled with
copies of their state. Every copy decodes its seed's greedy continuation, the pool holds
what a real run of the same batch holds at every decode step, no two sequences share a
slot, and what cannot run says why."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM
from sparsevllm.bench import throughput
from sparsevllm.cli import main

PROMPT_LEN, OUTPUT_LEN, BATCH = 40, 7, 4
_rng = random.Random(5)
# Random tokens, as the benchmark's prompts (no common first token: a real radix run would
# share that token's slot, which copies never do).
PROMPTS = [[_rng.randrange(3, 256) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]
assert len({p[0] for p in PROMPTS}) == BATCH
# Both caches (radix: vanilla, quest, omnikv), per-layer budgets (pyramidkv), per-head
# views (adakv), streaming heads (duoattention), state that moves with a chain (h2o, rkv).
METHODS = ["vanilla", "quest", "omnikv", "snapkv", "pyramidkv", "adakv", "duoattention", "h2o"]
METHODS += ["rkv"]
CASES = [(m, "auto") for m in METHODS]
CASES += [(m, f) for f in ("int8", "int4") for m in ("vanilla", "quest", "snapkv", "h2o", "adakv")]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def build(model: str, method: str, fmt: str) -> LLM:
    kivi = {"kv_quant_group_size": 8, "kv_quant_residual": 16} if fmt == "int4" else {}
    return LLM(
        model,
        dtype="float32",
        sparse_method=method,
        kv_cache_dtype=fmt,
        chunk_prefill_size=16,
        **METHOD_KNOBS[method],
        **kivi,
    )


def watch_views(llm: LLM) -> list[int]:
    """Check at every sampled token that no slot is in two sequences' views; returns the
    list of the numbers of views seen (one entry per token)."""
    pool, seen = llm.engine.pool, []

    def check(seq, token) -> None:
        for g in range(pool.num_groups):
            views = [t[g] for t in pool.tables.values()]
            assert len(set().union(*views)) == sum(len(v) for v in views), "a shared slot"
        seen.append(len(pool.tables))

    llm.engine.token_observers.append(check)
    return seen


@pytest.mark.parametrize("method, fmt", CASES)
def test_copies_decode_as_their_seed_with_the_memory_of_a_real_run(model, method, fmt):
    real_llm = build(model, method, fmt)
    # The real batch: B copies of the seed prompt for the chain cache (each its own
    # chain); under the radix cache, B distinct prompts of the same length (equal prompts
    # would share their cached slots), the seed first.
    radix = real_llm.engine.config.prefix_cache_mode == "radix"
    prompts = PROMPTS if radix else [PROMPTS[0]] * BATCH
    real = throughput.run_engine(real_llm, prompts, OUTPUT_LEN)
    llm = build(model, method, fmt)
    seen = watch_views(llm)
    run = throughput.run_engine(llm, PROMPTS[:1], OUTPUT_LEN, BATCH)
    assert run["seeds"] == [0] * BATCH and run["copy_s"] >= 0
    assert run["completions"] == [real["completions"][0]] * BATCH
    assert run["kv_layer_slots"] == real["kv_layer_slots"]  # every decode step
    assert len(run["decode_step_times"]) == len(real["decode_step_times"]) >= OUTPUT_LEN - 2
    assert run["cached_tokens"] == real["cached_tokens"] >= BATCH * PROMPT_LEN
    assert max(seen) == BATCH


def test_several_seeds_share_the_batch(model):
    """Three seeds over a batch of 8: copies 3, 3 and 2, each continuing its own seed."""
    real = throughput.run_engine(build(model, "snapkv", "auto"), PROMPTS[:3], OUTPUT_LEN)
    run = throughput.run_engine(build(model, "snapkv", "auto"), PROMPTS[:3], OUTPUT_LEN, 8)
    assert run["seeds"] == [0, 1, 2, 0, 0, 1, 1, 2]
    assert run["completions"] == [real["completions"][s] for s in run["seeds"]]


def cli(model: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--model", model, "--prompt-len", str(PROMPT_LEN)]
    args += ["--output-len", "6", "--dtype", "float32", *extra, "--json", str(out)]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_the_report_says_what_was_prefilled(model, tmp_path):
    r = cli(model, tmp_path, "--batch-size", "5", "--decode-capacity", "2")
    assert r["decode_capacity"] is True and r["batch_size"] == 5
    assert (r["prefilled_prompts"], r["copied_sequences"]) == (2, 3) and r["copy_s"] >= 0
    assert r["concurrency"] == 5 and r["num_preemptions"] == 0
    assert r["decode_phase_cached_tokens"] == 5 * PROMPT_LEN
    assert r["decode_steps_timed"] >= 3 and r["decode_tokens_per_s"] > 0
    assert r["end_to_end_tokens_per_s"] is None  # the batch was not all prefilled
    assert r["prefill_tokens_per_s"] > 0 and r["roofline_step_s"] > 0
    plain = cli(model, tmp_path, "--batch-size", "3")
    assert plain["decode_capacity"] is False and plain["prefilled_prompts"] == 3
    assert (plain["copied_sequences"], plain["copy_s"]) == (0, None)


def test_the_default_batch_is_the_largest(model, tmp_path):
    """No --batch-size: the largest batch, computed as without the mode; one seed."""
    pool = ["--num-kv-slots", "600", "--max-num-seqs", "64"]
    plain = cli(model, tmp_path, *pool)
    r = cli(model, tmp_path, "--decode-capacity", *pool)
    assert r["batch_size"] == plain["batch_size"] == 600 // (PROMPT_LEN + 6 + 1)
    assert r["prefilled_prompts"] == 1 and r["concurrency"] == r["batch_size"]
    assert r["num_preemptions"] == 0 and r["kv_slots_total"] == 600


def test_a_sweep_runs_each_length_in_the_mode(model, tmp_path):
    out = tmp_path / "s.json"
    args = ["bench", "throughput", "--model", model, "--sweep-prompt-lens", "48,24"]
    args += ["--output-len", "5", "--batch-size", "3", "--decode-capacity", "--dtype", "float32"]
    args += ["--sparse-method", "snapkv", "--decode-keep-tokens", "20"]
    args += ["--recent-keep-tokens", "8", "--json", str(out)]
    assert main(args) == 0
    reports = json.loads(out.read_text())
    assert [r["prompt_len"] for r in reports] == [24, 48]
    assert all((r["prefilled_prompts"], r["copied_sequences"]) == (1, 2) for r in reports)
    assert [r["decode_phase_cached_tokens"] for r in reports] == [72, 144]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "40", "--num-kv-slots", "400"], r"a batch of 40 exceeds the largest"),
        (["--batch-size", "2", "--decode-capacity", "3"], r"prefills more prompts than the batch"),
        (["--decode-capacity", "0"], r"at least one prompt"),
        (["--no-enable-prefix-caching"], r"needs prefix caching"),
        (["--compare", "hf"], r"drop --decode-capacity"),
    ],
)
def test_what_cannot_run_says_why(model, tmp_path, extra, message):
    args = ["bench", "throughput", "--model", model, "--prompt-len", str(PROMPT_LEN)]
    args += ["--output-len", "6", "--dtype", "float32", "--decode-capacity", *extra]
    with pytest.raises(SystemExit, match=message):
        main(args)


@pytest.mark.parametrize("method", ["vanilla", "snapkv"])
def test_sliding_window_layers_are_copied_too(tmp_path, method):
    """Gemma 3: under the chain cache a copy also holds its window groups' views (the
    window's newest tokens, in a group sized apart); under the radix cache they share
    its single group."""
    from tiny_gemma3 import save_tiny_gemma3

    gemma = save_tiny_gemma3(tmp_path / "gemma3")
    knobs = METHOD_KNOBS[method]
    real_llm = LLM(gemma, dtype="float32", sparse_method=method, max_num_seqs=8, **knobs)
    radix = real_llm.engine.config.prefix_cache_mode == "radix"
    real = throughput.run_engine(real_llm, PROMPTS if radix else [PROMPTS[0]] * BATCH, 5)
    llm = LLM(gemma, dtype="float32", sparse_method=method, max_num_seqs=8, **knobs)
    assert radix or llm.engine.pool.windows  # the chain cache has window groups
    seen = watch_views(llm)
    run = throughput.run_engine(llm, PROMPTS[:1], 5, BATCH)
    assert run["completions"] == [real["completions"][0]] * BATCH
    assert run["kv_layer_slots"] == real["kv_layer_slots"] and max(seen) == BATCH
