"""DuoAttention against a plain reference of its definition: which heads stream (the
paper's quantile rule, a threshold, a KV budget), what each head reads at every decode
step (retrieval: everything; streaming: sink + recent), what each layer keeps (a layer
whose heads all stream: at most sink + recent + interval), the equivalences with vanilla
(sparsity 0) and StreamingLLM (sparsity 1), chunking and preemption."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine_helpers import DUO_TINY_SCORES, MATRIX_PROMPTS
from sparsevllm import LLM, SamplingParams
from sparsevllm.calibration.head_scores import read_head_scores
from sparsevllm.sparse.duoattention import DuoAttention, streaming_count, streaming_views

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SINK, RECENT, INTERVAL = 2, 6, 4
KNOBS = {
    "sparse_method": "duoattention",
    "sink_keep_tokens": SINK,
    "recent_keep_tokens": RECENT,
    "duoattention_interval": INTERVAL,
    "duoattention_head_scores": DUO_TINY_SCORES,
}


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def quantile(values: list[float], p: float) -> float:
    """numpy's default (linear) quantile."""
    xs = sorted(values)
    pos = p * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def reference_streaming(scores: list[list[float]], sparsity: float) -> set[tuple[int, int]]:
    """The paper's deployment rule: heads below the sparsity-quantile stream (all at 1)."""
    flat = [(s, layer, h) for layer, row in enumerate(scores) for h, s in enumerate(row)]
    if sparsity >= 1:
        return {(layer, h) for _, layer, h in flat}
    threshold = quantile([s for s, _, _ in flat], sparsity)
    return {(layer, h) for s, layer, h in flat if s < threshold}


def test_the_sparsity_picks_the_papers_heads():
    rng = random.Random(0)
    for trial in range(200):
        layers, heads = rng.randint(1, 6), rng.randint(1, 4)
        scores = [[rng.random() for _ in range(heads)] for _ in range(layers)]
        sparsity = rng.choice([0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, rng.random()])
        expected = reference_streaming(scores, sparsity)
        assert streaming_count(layers * heads, sparsity) == len(expected), (trial, sparsity)
        method = _method(scores, duoattention_sparsity=sparsity)
        masks = method.streaming_heads(100)
        got = {(layer, h) for layer, m in masks.items() for h in range(heads) if m[h]}
        assert got == expected, (trial, sparsity)


def test_threshold_and_kv_budget_pick_heads():
    scores = [[0.9, 0.8], [0.1, 0.7], [0.2, 0.3], [0.6, 0.05]]
    method = _method(scores, duoattention_threshold=0.25)
    assert method.num_streaming(100) == 3  # 0.05, 0.1, 0.2
    budget = _method(scores, duoattention_kv_budget=500, sink=4, recent=32)
    assert budget.num_streaming(500) == 0 and budget.num_streaming(36) == 0
    for length in (501, 1000, 4096, 100_000):
        n = budget.num_streaming(length)
        assert _mean_kept(n, length) <= 500 and (n == 0 or _mean_kept(n - 1, length) > 500)


def _mean_kept(streaming: int, length: int, heads: int = 8, window: int = 36) -> float:
    """Mean tokens per head when `streaming` of `heads` keep `window` of `length`."""
    return ((heads - streaming) * length + streaming * window) / heads


def _method(scores: list[list[float]], sink: int = 2, recent: int = 6, **knobs) -> DuoAttention:
    from sparsevllm.calibration.head_scores import HeadScores
    from sparsevllm.calibration.schema import ModelIdentity
    from sparsevllm.config import EngineConfig

    config = EngineConfig.create(
        sparse_method="duoattention", sink_keep_tokens=sink, recent_keep_tokens=recent, **knobs
    )
    method = DuoAttention(config, len(scores), len(scores[0]))
    rows = tuple(tuple(r) for r in scores)
    method.use_scores(HeadScores(ModelIdentity(("m",)), len(scores), len(scores[0]), rows))
    return method


def test_streaming_views_read_sink_and_recent():
    contexts = torch.tensor([3, 8, 9, 30])
    streaming = torch.tensor([[True, False], [True, True], [False, True], [True, False]])
    subset, counts = streaming_views(contexts, streaming, SINK, RECENT)
    for r, c in enumerate(contexts.tolist()):
        for h in range(2):
            n = int(counts[r, h])
            read = subset[r, h, :n].tolist()
            if streaming[r, h] and c > SINK + RECENT:
                assert read == list(range(SINK)) + list(range(c - RECENT, c))
            else:
                assert read == list(range(c))


def trace_decode(llm: LLM, prompt: list[int], max_tokens: int):
    """Per step: the resident slots per layer, and each layer's decode reads as logical
    positions per KV head (None: the whole view)."""
    engine = llm.engine
    method = engine.runner.method
    views: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
    select = method.select_views

    def recording(layer, q, batch):
        out = select(layer, q, batch)
        views[layer] = None if out is None else (out[0].cpu(), out[1].cpu())
        return out

    method.select_views = recording
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    trace = []
    while engine.has_unfinished_requests():
        views.clear()
        engine.step()
        trace.append((engine.stats()["kv_slots_used_per_layer"], dict(views)))
    return trace


def test_each_head_reads_its_definition_and_streaming_layers_stay_bounded(model):
    llm = LLM(model, **KNOBS)
    prompt = MATRIX_PROMPTS[0]  # 61 tokens, one prefill step
    steps = 120
    trace = trace_decode(llm, prompt, steps)
    scores = read_head_scores(DUO_TINY_SCORES).scores
    streaming = reference_streaming([list(r) for r in scores if r is not None], 0.5)
    whole = {layer for layer in range(4) if all((layer, h) in streaming for h in range(2))}
    assert whole == {2}
    # After the prompt: layer 2 holds sink + recent, the others everything.
    assert trace[0][0] == [61, 61, SINK + RECENT, 61]
    for step, (resident, views) in enumerate(trace[1:], start=1):
        context = len(prompt) + step - 1  # logical tokens before this step's new one
        for layer in range(4):
            if layer == 2:
                assert resident[layer] <= SINK + RECENT + INTERVAL
            else:
                assert resident[layer] == context + 1  # retrieval heads keep everything
            has_streaming = any((layer, h) in streaming for h in range(2))
            assert (views.get(layer) is not None) == has_streaming, (step, layer)
            if not has_streaming:
                continue
            subset, lens = views[layer]
            view_len = resident[layer] - 1 if layer != 2 else None
            for h in range(2):
                n = int(lens[0, h])
                read = subset[0, h, :n].tolist()
                if (layer, h) not in streaming:
                    assert read == list(range(context)), (step, layer, h)
                    continue
                # Logical positions: the view is [sink | newest tokens]; the reference reads
                # the first SINK and the last RECENT tokens of the context.
                held = _view_len_before(trace, step, layer, context, view_len)
                logical = [p if p < SINK else context - (held - p) for p in read]
                assert logical == list(range(SINK)) + list(range(context - RECENT, context))
    peak = max(r[0][2] for r in trace[1:])
    assert peak == SINK + RECENT + INTERVAL  # the cut really waits for the interval


def _view_len_before(trace, step, layer, context, view_len):
    """Entries of the layer's view before this step's new token."""
    if view_len is not None:
        return view_len
    # Layer 2 was cut after the previous step or not: its view then grew by one.
    return trace[step - 1][0][layer]


def test_sparsity_zero_is_vanilla_with_chunks_and_preemption(model):
    vanilla = [o.token_ids for o in LLM(model).generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model, **KNOBS, duoattention_sparsity=0.0, num_kv_slots=110, chunk_prefill_size=7)
    assert [o.token_ids for o in llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)] == vanilla
    assert llm.stats()["num_preemptions"] > 0


def test_sparsity_one_is_streamingllm(model):
    """Every head streams: the same reads as StreamingLLM's (sink + recent + the new token)."""
    streaming = LLM(
        model, sparse_method="streamingllm", sink_keep_tokens=SINK, recent_keep_tokens=RECENT
    )
    ref = [o.token_ids for o in streaming.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model, **KNOBS, duoattention_sparsity=1.0)
    assert [o.token_ids for o in llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)] == ref
    mixed = LLM(model, **KNOBS)  # the default sparsity differs from both
    out = [o.token_ids for o in mixed.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)]
    assert out != ref


def test_chunked_prefill_selects_at_the_prompt_end(model):
    one = LLM(model, **KNOBS)
    ref = [o.token_ids for o in one.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)]
    for chunk in (7, 16):
        llm = LLM(model, **KNOBS, chunk_prefill_size=chunk)
        assert [o.token_ids for o in llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)] == ref


def test_preemption_finishes_and_frees_every_slot(model):
    llm = LLM(model, **KNOBS, num_kv_slots=120, chunk_prefill_size=7)
    params = SamplingParams(max_tokens=40, ignore_eos=True, seed=0)
    outs = llm.generate(MATRIX_PROMPTS * 2, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [40] * 8
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]


def test_every_head_streaming_frees_memory_for_more_sequences(model):
    prompts = [[1] + [(7 * i + j) % 250 + 3 for j in range(399)] for i in range(6)]
    common = {"num_kv_slots": 2 * 400 + 40, "max_model_len": 500, "chunk_prefill_size": 512}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(model, **KNOBS, duoattention_sparsity=1.0, **common)
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["max_concurrent_seqs"] > 2 and llm.stats()["num_preemptions"] == 0
    mixed = LLM(model, **KNOBS, **common)  # layer 0 retrieves: every token stays there
    mixed.generate(prompts, params, use_tqdm=False)
    assert mixed.stats()["max_concurrent_seqs"] <= 2


def test_prunes_a_chain_by_recency_and_continues_it(model):
    llm = LLM(model, **KNOBS)
    prompt = MATRIX_PROMPTS[0]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    result = llm.prune(out.chain_id, ranges=[(10, 40)], method="duoattention", keep_ratio=0.5)
    assert result.slots_freed > 0
    follow = llm.generate([prompt + out.token_ids + [5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert len(follow.token_ids) == 24 and follow.num_cached_tokens > 0
