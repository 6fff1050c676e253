"""Sliding-window layers keep only their window in the KV pool (Gemma 3's local layers).

Without radix prefix caching they live in a window group of their own: after every step
a sequence holds its newest window - 1 tokens there, whatever the sparse method does to
the full-attention layers, and the group never limits how many requests run.
"""

from __future__ import annotations

import pytest

from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.kv_pool import KVPool, PoolExhausted, WindowGroup
from tiny_gemma3 import WINDOW, save_tiny_gemma3

SLIDING, FULL = [0, 2], [1, 3]  # the tiny config's layer types
PROMPT = [1] + [(7 * i + 3) % 250 + 5 for i in range(39)]  # 40 tokens: five windows


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def per_layer_trace(llm: LLM, prompt: list[int], max_tokens: int) -> list[tuple[int, list[int]]]:
    """(tokens computed so far, resident slots per layer) after every step, one request."""
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    trace = []
    while engine.has_unfinished_requests():
        engine.step()
        seq = next(iter(engine.scheduler.running), None)
        if seq is not None:
            trace.append((seq.num_computed_tokens, engine.stats()["kv_slots_used_per_layer"]))
    return trace


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_sliding_layers_hold_window_minus_one(model: str, chunk: int) -> None:
    llm = LLM(model, enable_prefix_caching=False, chunk_prefill_size=chunk)
    trace = per_layer_trace(llm, PROMPT, max_tokens=12)
    assert len(trace) > 5
    for computed, used in trace:
        for layer in SLIDING:
            assert used[layer] == min(computed, WINDOW - 1)
        for layer in FULL:
            assert used[layer] == computed  # vanilla keeps everything on global layers


def test_methods_leave_sliding_layers_to_their_window(model: str) -> None:
    budget = 16
    llm = LLM(
        model,
        sparse_method="snapkv",
        decode_keep_tokens=budget,
        sink_keep_tokens=2,
        recent_keep_tokens=4,
        snapkv_window_size=4,
    )
    trace = per_layer_trace(llm, PROMPT, max_tokens=6)
    decoding = [(c, used) for c, used in trace if c > len(PROMPT)]
    assert decoding
    for computed, used in decoding:
        for layer in SLIDING:
            assert used[layer] == WINDOW - 1
        for layer in FULL:
            assert used[layer] == budget + computed - len(PROMPT)


def test_radix_caching_keeps_full_history_and_reuses_it(model: str) -> None:
    llm = LLM(model)  # vanilla: radix prefix cache on
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([PROMPT + [9, 9]], params, use_tqdm=False)[0]
    fresh = LLM(model, enable_prefix_caching=False).generate(
        [PROMPT + [9, 9]], params, use_tqdm=False
    )[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= len(PROMPT) - 1
    assert again.token_ids == fresh.token_ids


def test_window_group_does_not_limit_admission(model: str) -> None:
    # The main pool fits four 40 + 8 token requests; the window group is sized apart.
    llm = LLM(model, enable_prefix_caching=False, num_kv_slots=4 * 48, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1] + [(k * 5 + i) % 250 + 5 for i in range(39)] for k in range(8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert all(len(o.token_ids) == 8 for o in outs)
    assert stats["max_concurrent_seqs"] == 4 and stats["num_preemptions"] == 0


def test_pool_trim_frees_and_window_room_is_checked() -> None:
    pool = KVPool(100, 3, [[0, 2]], [WindowGroup([1], window=4, num_slots=10)])
    pool.append(7, 6)
    assert pool.num_resident(7, 1) == 6 and pool.num_used == 6
    tail = pool.table(7, 1)[-3:]
    assert pool.trim(7) == [1]
    assert pool.table(7, 1) == tail and pool.num_resident(7, 0) == 6
    assert pool.trim(7) == []  # already within the window
    assert pool.used_per_layer() == [6, 3, 6]
    with pytest.raises(PoolExhausted, match="sliding-window group"):
        pool.append(8, 8)  # 3 + 8 > 10 window slots, though the main pool has room
    assert not pool.has(8) and pool.num_used == 6
    pool.release(7)
    assert pool.used_per_layer() == [0, 0, 0]


def test_solo_full_prefill_fits_the_window_group(model: str) -> None:
    # long_bs1full_short_batch computes a long prompt in one step, past the step budget
    # the window group is otherwise sized for (16 tokens here, the prompt has 40).
    kwargs = dict(
        sparse_method="pyramidkv",
        decode_keep_tokens=4096,
        long_prefill_offload_threshold=16,
        max_num_batched_tokens=16,
        chunk_prefill_size=16,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = LLM(model, **kwargs).generate([PROMPT], params, use_tqdm=False)[0]
    ref = LLM(model, enable_prefix_caching=False).generate([PROMPT], params, use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids
