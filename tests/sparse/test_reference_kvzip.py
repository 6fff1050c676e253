"""KVzip against a plain reference of its definition, computed with Hugging Face
transformers on the same tiny checkpoint (float32 model, float64 scores).

Reference: prefill the prompt (P tokens) into a cache; for each chunk [a, b) of C
tokens, run the reconstruction input (repeat prompt + tokens [a, b); later chunks: the
continue prompt + tokens [a - overlap, b)) at positions P.. over a copy of the cache;
at every layer take the post-RoPE queries and keys that attention receives, and for
every query head and query the softmax over the sink keys, the chunk's segment [a, b)
and the input's own keys (causal); a context entry's score is the max over the KV
head's query heads and the queries. Each KV head keeps sink + recent + the best of the
middle (`ref_keep`). The engine must keep the same positions, whatever its prefill
chunking, batching or kv_cache_dtype of the others.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import MATRIX_PROMPTS, METHOD_KNOBS
from eviction_harness import ref_keep
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.sparse.kvzip import KVzip, KVzipKnobs, prune_scores, reconstruction_scores
from sparsevllm.sparse.registry import method_spec

PROMPTS = [[1] + [(7 * j) % 240 + 10 for j in range(60)], [1] + list(range(100, 140))]
KNOBS = dict(
    decode_keep_tokens=20,
    sink_keep_tokens=2,
    recent_keep_tokens=4,
    kvzip_repeat_prompt="w1 w2 w3",
    kvzip_continue_prompt="w4 w5",
    kvzip_overlap_tokens=3,
)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


_CAPTURED: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []


def reference_scores(model_dir: str, prompt: list[int], chunk: int) -> list[torch.Tensor]:
    """`[layer] -> [Hkv, P]` KVzip scores of the prompt's entries (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    eager = modeling_llama.eager_attention_forward

    def capture(module, query, key, value, attention_mask, scaling, **kwargs):
        _CAPTURED.append((module.layer_idx, query[0].double(), key[0].double(), float(scaling)))
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = hf.config
    hq, hkv, sink = cfg.num_attention_heads, cfg.num_key_value_heads, KNOBS["sink_keep_tokens"]
    group, length = hq // hkv, len(prompt)
    scores = [torch.zeros(hkv, length, dtype=torch.float64) for _ in range(cfg.num_hidden_layers)]
    modeling_llama.eager_attention_forward = capture
    try:
        with torch.no_grad():
            cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
            for c, a in enumerate(range(0, length, chunk)):
                b = min(a + chunk, length)
                if c == 0:
                    ids = tok.encode(KNOBS["kvzip_repeat_prompt"], add_special_tokens=False)
                    ids += prompt[a:b]
                else:
                    ids = tok.encode(KNOBS["kvzip_continue_prompt"], add_special_tokens=False)
                    ids += prompt[max(0, a - KNOBS["kvzip_overlap_tokens"]) : b]
                n = len(ids)
                _CAPTURED.clear()
                positions = torch.arange(length, length + n)[None]
                hf(torch.tensor([ids]), cache=copy.deepcopy(cache), position_ids=positions)
                scored = sorted(set(range(min(sink, length))) | set(range(a, b)))
                for layer, q, k, scale in _CAPTURED:  # q [Hq, n, D], k [Hkv, P + n, D]
                    for h in range(hq):
                        keys = k[h // group]
                        for i in range(n):
                            cols = scored + list(range(length, length + i + 1))
                            probs = (keys[cols] @ q[h, i] * scale).softmax(dim=0)
                            row = scores[layer][h // group]
                            row[scored] = torch.maximum(row[scored], probs[: len(scored)])
    finally:
        modeling_llama.eager_attention_forward = eager
    return scores


def reference_keep(scores: torch.Tensor, budget: int) -> list[list[int]]:
    length = scores.shape[1]
    sink, recent = KNOBS["sink_keep_tokens"], KNOBS["recent_keep_tokens"]
    out = []
    for row in scores.tolist():
        order = sorted(range(length), key=lambda j: (-row[j], -j))
        out.append(ref_keep(order, length, budget, sink, recent))
    return out


def engine_keeps(model_dir: str, prompts, monkeypatch, **kwargs) -> dict[tuple[int, int], list]:
    """(request index, layer) -> `[Hkv][B]` view positions the engine kept (a fresh
    prompt's view positions are its logical positions)."""
    kept: dict[tuple[int, int], list] = {}
    original = RunnerKV.keep_per_head

    def record(self, seq_id, layer, positions):
        kept[(seq_id, layer)] = positions.tolist()
        return original(self, seq_id, layer, positions)

    monkeypatch.setattr(RunnerKV, "keep_per_head", record)
    llm = LLM(model_dir, sparse_method="kvzip", dtype="float32", **{**KNOBS, **kwargs})
    outs = llm.generate(prompts, ONE, use_tqdm=False)
    assert all(len(o.token_ids) == 1 for o in outs)
    order = {s: i for i, s in enumerate(sorted({s for s, _ in kept}))}
    return {(order[s], layer): v for (s, layer), v in kept.items()}, llm


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("prefill_chunk", [7, 2048])
def test_engine_keeps_the_reference_selection(model, monkeypatch, chunk, prefill_chunk):
    kept, llm = engine_keeps(
        model, PROMPTS, monkeypatch, kvzip_chunk_size=chunk, chunk_prefill_size=prefill_chunk
    )
    stats = llm.stats()
    assert stats["scoring_passes"] == 2
    assert stats["scoring_forwards"] == sum(-(-len(p) // chunk) for p in PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        ref = reference_scores(model, prompt, chunk)
        for layer, scores in enumerate(ref):
            want = reference_keep(scores, KNOBS["decode_keep_tokens"])
            assert kept[(i, layer)] == want, (i, layer)
    # Heads choose differently, and the reconstruction chunking matters.
    assert kept[(0, 0)][0] != kept[(0, 0)][1]


def test_chunking_matters_to_the_reference(model):
    """The test above can fail: two reconstruction chunkings keep different entries."""
    a = reference_keep(reference_scores(model, PROMPTS[0], 16)[0], 20)
    b = reference_keep(reference_scores(model, PROMPTS[0], 64)[0], 20)
    assert a != b


def test_preemption_rescoring_and_batching_keep_the_selection(model, monkeypatch):
    """A small pool preempts; every request's final compression is the reference's,
    and the batch mixes a request that fits its budget (no pass)."""
    short = [1, 5, 6, 7]
    prompts = [PROMPTS[0], short, PROMPTS[1], PROMPTS[0]]
    kept, llm = engine_keeps(
        model, prompts, monkeypatch, kvzip_chunk_size=16, chunk_prefill_size=7, num_kv_slots=80
    )
    assert llm.stats()["num_preemptions"] > 0
    ref0 = [reference_keep(s, 20) for s in reference_scores(model, PROMPTS[0], 16)]
    ref1 = [reference_keep(s, 20) for s in reference_scores(model, PROMPTS[1], 16)]
    # The last compression of each long request (a preempted one is compressed again).
    seqs = sorted({s for s, _ in kept})
    finals = [[kept[(s, layer)] for layer in range(2)] for s in seqs]
    assert ref0 in finals and ref1 in finals


def test_a_pass_without_eviction_leaves_no_trace(model, monkeypatch):
    """Forced scoring passes with a budget over the context: vanilla's tokens, batched,
    chunked, in int8 too (the pass's K/V never reach the views or the pool)."""
    monkeypatch.setattr(KVzip, "evicts", lambda self, resident: True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for fmt in ("auto", "int8"):
        common = dict(chunk_prefill_size=7, kv_cache_dtype=fmt)
        van = LLM(model, **common).generate(PROMPTS, greedy, use_tqdm=False)
        llm = LLM(model, sparse_method="kvzip", decode_keep_tokens=4096, **common)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in van]
        stats = llm.stats()
        assert stats["scoring_passes"] == 2 and stats["scoring_tokens"] > sum(map(len, PROMPTS))
        assert stats["kv_slots_used"] == stats["kv_slots_cached"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_quantized_kv_keeps_the_budget(model, fmt):
    llm = LLM(model, sparse_method="kvzip", kv_cache_dtype=fmt, kvzip_chunk_size=16, **KNOBS)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the whole prompt, its reconstruction and the compression
    assert engine.stats()["kv_slots_used_per_layer"] == [20, 20]
    assert engine.stats()["scoring_forwards"] == 4


def test_a_chain_turn_reconstructs_only_its_new_tokens(model):
    llm = LLM(model, sparse_method="kvzip", kvzip_chunk_size=16, **KNOBS)
    first = llm.generate([PROMPTS[0]], ONE, use_tqdm=False)[0]
    before = llm.stats()["scoring_tokens"]
    turn2 = PROMPTS[0] + first.token_ids + list(range(30, 55))  # continues the chain
    out = llm.generate([turn2], ONE, use_tqdm=False)[0]
    assert out.num_cached_tokens == len(PROMPTS[0])
    # The 26 new tokens in chunks of 16: repeat prompt (3) + 16, then the continue
    # prompt (2) + the 3 overlapping tokens + 10; the compressed history is not replayed.
    assert llm.stats()["scoring_tokens"] - before == 3 + 16 + 2 + 3 + 10


def test_reconstruction_scores_match_a_loop():
    g = torch.Generator().manual_seed(0)
    n, m, hq, hkv, d = 5, 7, 4, 2, 8
    q, ctx, own = (torch.randn(*s, generator=g) for s in ((n, hq, d), (m, hkv, d), (n, hkv, d)))
    got = reconstruction_scores(q, ctx, own, 0.3)
    want = torch.zeros(hkv, m, dtype=torch.float64)
    for h in range(hq):
        for i in range(n):
            keys = torch.cat([ctx[:, h // 2], own[: i + 1, h // 2]]).double()
            p = (keys @ q[i, h].double() * 0.3).softmax(dim=0)[:m]
            want[h // 2] = torch.maximum(want[h // 2], p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_prune_scores_match_a_loop():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(9, 2, 8, generator=g)
    positions = torch.tensor([[0, 1, 2, 5, 6, 7, 9, 10, 12], [0, 1, 3, 4, 6, 8, 9, 11, 12]])
    got = prune_scores(keys, positions, KVzipKnobs())
    want = torch.zeros(2, 9, dtype=torch.float64)
    for h in range(2):
        for i in range(9):  # entry i's key as a query over the entries not after it
            cols = [j for j in range(9) if positions[h, j] <= positions[h, i]]
            p = (keys[cols, h].double() @ keys[i, h].double() / 8**0.5).softmax(dim=0)
            want[h, cols] = torch.maximum(want[h, cols], p)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


def test_mixed_batch_gives_each_request_its_methods_tokens(tiny_model_factory):
    """KVzip rows beside SnapKV, H2O and vanilla rows in chunked, batched steps: each
    request gets the tokens of an engine serving only its method (the pass of one row
    leaves the others' KV alone)."""
    model = tiny_model_factory("llama4")
    methods = ["kvzip", "snapkv", "kvzip", "vanilla", "h2o", "kvzip", "vanilla", "kvzip"]
    prompts = (MATRIX_PROMPTS + [p[:-2] + [7, 8] for p in MATRIX_PROMPTS])[: len(methods)]
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    want: dict[int, list[int]] = {}
    for method in set(methods):
        idx = [i for i, m in enumerate(methods) if m == method]
        llm = LLM(model, sparse_method=method, chunk_prefill_size=7, **METHOD_KNOBS[method])
        outs = llm.generate([prompts[i] for i in idx], SamplingParams(**greedy), use_tqdm=False)
        want.update({i: o.token_ids for i, o in zip(idx, outs)})

    def params(method: str) -> SamplingParams:
        spec = method_spec(method)
        knobs = {k: v for k, v in METHOD_KNOBS[method].items() if k in spec.settings}
        return SamplingParams(**greedy, sparse_method=method, sparse_knobs=knobs)

    # The engine's own kvzip settings size the pass's scratch slots (a request may not
    # ask for longer inputs).
    kvzip = {"sparse_method": "kvzip", "kvzip_chunk_size": 16}
    llm = LLM(model, **kvzip, sparse_methods=["vanilla", "snapkv", "h2o"], chunk_prefill_size=7)
    outs = llm.generate(prompts, [params(m) for m in methods], use_tqdm=False)
    assert [o.token_ids for o in outs] == [want[i] for i in range(len(methods))]
    assert llm.stats()["scoring_passes"] == 3  # the long kvzip prompts (one fits its budget)


def test_sliding_window_model_without_a_tokenizer(tmp_path, monkeypatch):
    """Gemma 3 (sliding layers in window groups; no tokenizer: the instructions are
    dropped, the pass replays the context alone). A pass that evicts nothing leaves
    vanilla's tokens; one that evicts keeps the budget in the global layers only."""
    from tiny_gemma3 import WINDOW, save_tiny_gemma3

    model = save_tiny_gemma3(tmp_path / "gemma3")
    prompts = [[1] + [(7 * i + 3) % 250 + 5 for i in range(39)], [1] + list(range(60, 90))]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    common = dict(enable_prefix_caching=False, chunk_prefill_size=7)
    van = LLM(model, **common).generate(prompts, greedy, use_tqdm=False)
    with monkeypatch.context() as m:
        m.setattr(KVzip, "evicts", lambda self, resident: True)
        knobs = dict(decode_keep_tokens=4096, kvzip_overlap_tokens=0)
        llm = LLM(model, sparse_method="kvzip", **knobs, **common)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in van]
    assert llm.stats()["scoring_tokens"] == sum(map(len, prompts))  # no text: no tokenizer
    knobs = dict(decode_keep_tokens=12, recent_keep_tokens=4, kvzip_chunk_size=8)
    llm = LLM(model, sparse_method="kvzip", **knobs, **common)
    engine = llm.engine
    engine.add_request(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.running[0].num_computed_tokens < 40:
        engine.step()
    assert engine.stats()["kv_slots_used_per_layer"] == [WINDOW - 1, 12, WINDOW - 1, 12]
