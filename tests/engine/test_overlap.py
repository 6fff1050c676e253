"""Overlapped scheduling (async_scheduling): steps scheduled ahead give the same tokens,
finishes and cache state as the plain loop (CPU: the overlap itself is a GPU effect,
the bookkeeping is the same)."""

from __future__ import annotations

import pytest

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams

PROMPTS = [[1] + list(range(10 + 7 * i, 40 + 9 * i)) for i in range(6)]
KNOBS = {
    m: METHOD_KNOBS[m]
    for m in ("vanilla", "snapkv", "pyramidkv", "adakv", "quest", "omnikv", "h2o", "streamingllm")
}
OPTS_OUT = {"h2o", "streamingllm"}  # they evict while decoding: never scheduled ahead


def engine(model: str, method: str, overlap: bool, max_num_seqs: int = 8, **kw) -> LLM:
    return LLM(
        model,
        dtype="float32",
        sparse_method=method,
        max_num_seqs=max_num_seqs,
        chunk_prefill_size=16,
        async_scheduling=overlap,
        **KNOBS[method],
        **kw,
    )


def stopping_params(model: str, method: str, **kw) -> list[SamplingParams]:
    """Per request: varied max_tokens, and for half of them a stop token that the greedy
    output really produces mid-way (found with a plain run): requests finish at
    different steps, by length and by a stop token sampled in a step scheduled ahead."""
    base = [SamplingParams(temperature=0.0, max_tokens=14 + 2 * i) for i in range(6)]
    outs = engine(model, method, False, **kw).generate(PROMPTS, base, use_tqdm=False)
    params = []
    for i, (p, o) in enumerate(zip(base, outs)):
        stop = None
        fresh = [j for j in range(8, len(o.token_ids)) if o.token_ids[j] not in o.token_ids[:j]]
        if fresh and i % 2 == 0:  # a token's first occurrence: the request stops there
            stop = [o.token_ids[fresh[i % len(fresh)]]]
        params.append(SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=stop))
    return params


@pytest.mark.parametrize("max_num_seqs", [8, 4], ids=["all-running", "admissions"])
@pytest.mark.parametrize("method", sorted(KNOBS))
def test_same_outputs_as_without_overlap(tiny_model_factory, method, max_num_seqs):
    model = tiny_model_factory("llama4")
    params = stopping_params(model, method, max_num_seqs=max_num_seqs)
    plain_llm = engine(model, method, False, max_num_seqs)
    plain = plain_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = engine(model, method, True, max_num_seqs)
    ahead = llm.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ahead, plain):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
    assert any(o.finish_reason == "stop" for o in plain)
    overlap = llm.engine.loop
    if method in OPTS_OUT:
        assert overlap.num_steps_ahead == 0
    else:
        assert overlap.num_steps_ahead > 5
        if max_num_seqs == 8:  # stop tokens sampled while the next step was in flight
            assert overlap.num_dropped > 0
    # Finished requests left the same cached state (radix nodes or parked chains).
    assert llm.engine.pool.num_used == plain_llm.engine.pool.num_used
    assert not llm.engine.scheduler.running and overlap.ahead is None


@pytest.mark.parametrize("method", ["vanilla", "snapkv"])  # radix cache; chain cache
def test_next_turn_reuses_the_same_cached_state(tiny_model_factory, method):
    model = tiny_model_factory("llama4")
    params = stopping_params(model, method)
    turns = []
    for overlap in (False, True):
        llm = engine(model, method, overlap)
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        follow = [list(p) + o.token_ids + [7, 8, 9] for p, o in zip(PROMPTS, first)]
        second = llm.generate(follow, SamplingParams(temperature=0.0, max_tokens=6), False)
        used = llm.engine.pool.num_used
        turns.append(
            ([o.token_ids for o in first + second], [o.num_cached_tokens for o in second], used)
        )
    assert turns[0] == turns[1]
    assert sum(turns[0][1]) > 0  # the second turn did reuse cached state


def test_abort_while_a_step_is_scheduled_ahead(tiny_model_factory):
    model = tiny_model_factory("llama4")
    results = []
    for overlap in (False, True):
        llm = engine(model, "vanilla", overlap, enable_prefix_caching=False)
        e = llm.engine
        ids = [
            e.add_request(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in PROMPTS[:3]
        ]
        tokens: dict[str, list[int]] = {}
        for k in range(40):
            if k == 6:
                assert e.abort_request(ids[1])
            for out in e.step():
                tokens[out.request_id] = out.token_ids
            if not e.has_unfinished_requests():
                break
        e.drain()
        assert e.pool.num_used == 0  # every slot came back, the aborted one's too
        results.append([tokens[i] for i in ids])
    assert results[0] == results[1]
    assert len(results[0][1]) < 12  # aborted mid-way


def test_min_tokens_boundary(tiny_model_factory):
    """A stop token allowed from exactly min_tokens on: the step that samples it must see
    the full history (no step scheduled ahead for it), so it stops where it should."""
    model = tiny_model_factory("llama4")
    base = SamplingParams(temperature=0.0, max_tokens=20)
    first = engine(model, "vanilla", False).generate(PROMPTS, base, use_tqdm=False)[0].token_ids
    m = next(j for j in range(6, 20) if first[j] not in first[:j])
    params = [base] * len(PROMPTS)
    params[0] = SamplingParams(
        temperature=0.0, max_tokens=20, min_tokens=m, stop_token_ids=[first[m]]
    )
    outs = []
    for overlap in (False, True):
        llm = engine(model, "vanilla", overlap)
        outs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    assert outs[0] == outs[1]
    assert outs[1][0] == first[: m + 1]  # stopped at the first token min_tokens allows
    assert llm.engine.loop.num_steps_ahead > 5


def test_sampling_with_history_is_not_scheduled_ahead(tiny_model_factory):
    model = tiny_model_factory("llama4")
    llm = engine(model, "vanilla", True)
    params = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, logprobs=2)
    plain = engine(model, "vanilla", False).generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.loop.num_steps_ahead == 0


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "chain"])
def test_sliding_window_layers(tmp_path, caching):
    """Gemma 3's window groups are trimmed after every step, the steps scheduled ahead
    too; with the chain cache (which parks a window) nothing is scheduled ahead."""
    from tiny_gemma3 import save_tiny_gemma3

    model = save_tiny_gemma3(tmp_path / "gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    kw = dict(dtype="float32", sparse_method="snapkv", decode_keep_tokens=24)
    kw.update(recent_keep_tokens=4, chunk_prefill_size=16, enable_prefix_caching=caching)
    runs = []
    for overlap in (False, True):
        llm = LLM(model, async_scheduling=overlap, **kw)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        assert llm.engine.pool.windows  # the model has window groups here
    assert runs[0] == runs[1]
    ahead = llm.engine.loop.num_steps_ahead
    assert ahead == 0 if caching else ahead > 5


def test_overlap_defaults_to_the_device(tiny_model_factory) -> None:
    """Unset, async_scheduling follows the device (off on CPU, where the host computes
    the step itself); set, it is obeyed; anything but a bool is refused."""
    model = tiny_model_factory("llama")
    assert LLM(model, dtype="float32").engine.async_scheduling is False
    assert LLM(model, dtype="float32", async_scheduling=True).engine.async_scheduling is True
    with pytest.raises((TypeError, ValueError), match="async_scheduling"):
        LLM(model, async_scheduling="yes")
