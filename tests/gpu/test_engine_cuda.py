"""The engine on CUDA (Triton kernels, CUDA-graph decode) against the CPU reference path."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    [1] + list(range(10, 70)),
    [1] + list(range(100, 125)),
    [1, 5, 6],
    [1] + list(range(200, 241)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
CASES = {
    m: METHOD_KNOBS[m]
    for m in (
        "vanilla",
        "streamingllm",
        "snapkv",
        "adakv",
        "h2o",
        "rkv",
        "tova",
        "quest",
        "omnikv",
        "expected_attention",
    )
}
# Ada-KV's per-head views (decode reads per-KV-head counts) without max-pool plateaus,
# whose ties the two paths may break differently.
CASES["adakv"] = {**CASES["adakv"], "snapkv_pool_kernel_size": 1}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


# Methods whose choices rest on top-k over scores: the CUDA and CPU paths compute the
# scores in a different order, so near-ties (max-pooled plateaus, equal page bounds) can
# pick different tokens. They are checked below with budgets that cover the context.
SELECTING = {"snapkv", "quest", "omnikv"}


@pytest.mark.parametrize("method", [m for m in CASES if m not in SELECTING])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_matches_cpu_reference(model, method, eager):
    kwargs = dict(sparse_method=method, dtype="float32", chunk_prefill_size=16, **CASES[method])
    cpu = LLM(model, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    # A small pool: engines of earlier tests may not be garbage-collected yet.
    gpu_llm = LLM(model, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1, **kwargs)
    gpu = gpu_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.runner.backend.name == "triton"
    assert (gpu_llm.engine.runner.graphs is None) == eager


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_decode_views_inside_decode_graphs(model, method, monkeypatch):
    """Quest's and OmniKV's decode steps replay CUDA graphs (their views computed inside
    them, OmniKV from its full layers' probabilities) and give the tokens of the eager
    CUDA path, Quest's pages completing mid-decode."""
    from sparsevllm.engine.cuda_graph import DecodeGraphs

    kwargs = dict(
        sparse_method=method, dtype="float32", chunk_prefill_size=16, kv_cache_memory_gb=1
    )
    kwargs.update(CASES[method])
    eager = LLM(model, device="cuda", enforce_eager=True, **kwargs)
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    replays: list[int] = []
    run = DecodeGraphs.run
    monkeypatch.setattr(
        DecodeGraphs, "run", lambda self, b, ids: replays.append(b.num_seqs) or run(self, b, ids)
    )
    llm = LLM(model, device="cuda", **kwargs)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    assert len(replays) >= GREEDY.max_tokens - 2  # the decode steps, graphs throughout


def test_eager_decode_views_run_outside_decode_graphs(model, monkeypatch):
    """A method whose decode views need host data (DecodeViews.EAGER) never replays a
    decode graph, and gives the tokens of the graph-computed views."""
    from sparsevllm.engine.cuda_graph import DecodeGraphs
    from sparsevllm.sparse.quest import Quest
    from sparsevllm.sparse.spec import DecodeViews

    kwargs = dict(sparse_method="quest", dtype="float32", chunk_prefill_size=16)
    kwargs.update(CASES["quest"], kv_cache_memory_gb=1)
    want = [
        o.token_ids
        for o in LLM(model, device="cuda", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    ]
    replays: list[int] = []
    run = DecodeGraphs.run
    monkeypatch.setattr(
        DecodeGraphs, "run", lambda self, b, ids: replays.append(b.num_seqs) or run(self, b, ids)
    )
    monkeypatch.setattr(Quest, "decode_views", DecodeViews.EAGER)
    llm = LLM(model, device="cuda", **kwargs)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    assert llm.engine.runner.graphs is not None and replays == []


@pytest.mark.parametrize("method", sorted(SELECTING))
def test_selecting_methods_on_cuda(model, method):
    vanilla = LLM(model, device="cpu", dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
    big = dict(CASES[method], decode_keep_tokens=4096, recent_keep_tokens=8)
    llm = LLM(
        model, device="cuda", dtype="float32", kv_cache_memory_gb=1, sparse_method=method, **big
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in vanilla]
    small = LLM(
        model,
        device="cuda",
        dtype="float32",
        kv_cache_memory_gb=1,
        sparse_method=method,
        chunk_prefill_size=16,
        **CASES[method],
    )
    outs = small.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)


def test_bf16_logits_close_to_transformers(model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    llm = LLM(model, device="cuda", dtype="bfloat16", kv_cache_memory_gb=1)
    prompt = PROMPTS[0]
    ours = llm.prompt_logits(prompt).cpu()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 2e-2, rel


GEMMA_CASES = {
    "radix-full-history": {},
    "window-group": {"enable_prefix_caching": False},
    "snapkv": {"sparse_method": "snapkv", "decode_keep_tokens": 4096},
    "quest": {"sparse_method": "quest", "decode_keep_tokens": 4096, "quest_chunk_size": 4},
}


@pytest.mark.parametrize("case", GEMMA_CASES.values(), ids=GEMMA_CASES.keys())
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gemma3_sliding_windows_on_cuda(tmp_path, case, eager):
    # Sliding layers on the Triton kernels: the window inside prefill chunks (chunk 5 <
    # window 8 < prompt) and at decode, both with full history (radix) and trimmed views.
    from tiny_gemma3 import save_tiny_gemma3

    path = save_tiny_gemma3(tmp_path)
    kwargs = dict(dtype="float32", chunk_prefill_size=5, **case)
    cpu = LLM(path, device="cpu", **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)
    gpu_llm = LLM(path, device="cuda", enforce_eager=eager, kv_cache_memory_gb=1, **kwargs)
    gpu = gpu_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
