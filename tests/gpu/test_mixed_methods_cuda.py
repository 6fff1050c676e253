"""Per-request methods on CUDA: a mixed batch (Triton kernels, decode graphs with views
merged by row) gives each request its own method's tokens from a single-method engine."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.sparse.registry import method_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [
    [1] + list(range(10, 70)),
    [1] + list(range(100, 125)),
    [1, 5, 6],
    [1] + list(range(200, 241)),
    [1] + list(range(30, 80)),
    [1] + list(range(140, 170)),
]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
ENGINE = {"device": "cuda", "dtype": "float32", "chunk_prefill_size": 16, "kv_cache_memory_gb": 1}
# Per-layer eviction beside one-group methods (chain cache), and the radix mix whose two
# graph-view methods share every decode graph.
MIXES = {
    "evicting": ["vanilla", "snapkv", "h2o", "streamingllm", "tova", "omnikv"],
    "prefix": ["vanilla", "quest", "omnikv"],
}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def request_knobs(method: str) -> dict:
    return {k: v for k, v in METHOD_KNOBS[method].items() if k in method_spec(method).settings}


def single_method_tokens(model: str, methods: list[str], eager: bool) -> list[list[int]]:
    out = {}
    for method in set(methods):
        idx = [i for i, m in enumerate(methods) if m == method]
        llm = LLM(
            model, sparse_method=method, enforce_eager=eager, **ENGINE, **METHOD_KNOBS[method]
        )
        outs = llm.generate([PROMPTS[i] for i in idx], SamplingParams(**GREEDY), use_tqdm=False)
        out.update({i: o.token_ids for i, o in zip(idx, outs)})
        del llm
    return [out[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_mixed_batch_on_cuda_equals_single_method_engines(model, mix, eager, monkeypatch):
    from sparsevllm.engine.cuda_graph import DecodeGraphs

    served = MIXES[mix]
    methods = [served[i % len(served)] for i in range(len(PROMPTS))]
    want = single_method_tokens(model, methods, eager)
    replays: list[int] = []
    run = DecodeGraphs.run
    monkeypatch.setattr(
        DecodeGraphs, "run", lambda self, b, ids: replays.append(b.num_seqs) or run(self, b, ids)
    )
    llm = LLM(model, sparse_methods=served[1:], enforce_eager=eager, **ENGINE)
    params = [
        SamplingParams(**GREEDY, sparse_method=m, sparse_knobs=request_knobs(m)) for m in methods
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    if not eager and mix == "prefix":  # no row evicts while decoding: graphs throughout
        assert len(replays) >= GREEDY["max_tokens"] - 2
    stats = llm.stats()
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]
