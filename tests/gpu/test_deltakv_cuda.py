"""DeltaKV serving on CUDA (the torch reference backend reads its storage there): greedy
tokens and logprobs equal the plain Hugging Face reference of tests/deltakv_serving.py
run on the same GPU in float32, at one chunk and at small chunks, INT4 and float16
latents; with budgets covering the context the tokens equal the dense model's.

The oracle runs on the GPU too: a CPU run is no oracle for a GPU one, because INT4
rounding and the nearest-center search turn last-bit differences between the devices'
GEMMs into different codes, and a tiny random model's near-tied logits into different
tokens."""

from __future__ import annotations

import pytest
import torch

from deltakv_serving import ReferenceServing, make_checkpoint
from engine_helpers import MATRIX_PROMPTS
from sparsevllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
RECENT = 8


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> str:
    return make_checkpoint(model, tmp_path_factory.mktemp("deltakv") / "c.safetensors")


def cuda_llm(model: str, **kw) -> LLM:
    # A small pool: the module's engines live side by side until collected.
    return LLM(model, device="cuda", dtype="float32", kv_cache_memory_gb=0.5, **kw)


@pytest.mark.parametrize("bits,chunk,interval", [(4, 512, 1), (16, 512, 16), (4, 7, 5)])
def test_tokens_equal_the_reference_on_the_gpu(model, checkpoint, bits, chunk, interval):
    llm = cuda_llm(
        model,
        sparse_method="deltakv",
        deltakv_checkpoint=checkpoint,
        recent_keep_tokens=RECENT,
        deltakv_latent_bits=bits,
        chunk_prefill_size=chunk,
        deltakv_compress_interval=interval,
    )
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(MATRIX_PROMPTS, outs):
        ref = ReferenceServing(
            model, checkpoint, RECENT, bits=bits, device="cuda", interval=interval
        )
        assert out.token_ids == ref.generate(prompt, chunk, GREEDY.max_tokens)
        got = [t.logprob for t in out.logprobs]
        assert got == pytest.approx(ref.logprobs, abs=1e-3)


def test_budgets_covering_the_context_give_the_dense_model_on_the_gpu(model, checkpoint):
    llm = cuda_llm(
        model, sparse_method="deltakv", deltakv_checkpoint=checkpoint, recent_keep_tokens=1024
    )
    outs = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(MATRIX_PROMPTS, outs):
        # A window of 1,024 compresses nothing: the reference is the plain HF loop.
        dense = ReferenceServing(model, checkpoint, 1024, device="cuda")
        assert out.token_ids == dense.generate(prompt, 2048, GREEDY.max_tokens)


@pytest.mark.parametrize("kernel,topk", [("rebuild", 0), ("fused", 0), ("rebuild", 4)])
def test_deltakv_decode_graphs_give_the_eager_tokens(
    tiny_model_factory, tmp_path, kernel, topk, monkeypatch
):
    """Decode steps over whole views replay captured graphs (the store, the kernel and,
    for `rebuild`, a scratch sized from the slot table's width inside the graph) and give
    the eager engine's tokens and logprobs, with compression between the steps; a top-k
    that narrows the views keeps its steps eager. (head_dim 64: the kernels read it.)"""
    model = tiny_model_factory("llama_hd64")
    kwargs = dict(
        sparse_method="deltakv", deltakv_checkpoint=make_checkpoint(model, tmp_path / "c.st"),
        recent_keep_tokens=RECENT, deltakv_decode_kernel=kernel, deltakv_topk=topk,
        deltakv_compress_interval=4, chunk_prefill_size=32,
    )  # fmt: skip
    want = cuda_llm(model, enforce_eager=True, **kwargs).generate(
        MATRIX_PROMPTS, GREEDY, use_tqdm=False
    )
    llm = cuda_llm(model, **kwargs)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    replays = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda *a: replays.append(1) or run(*a))
    got = llm.generate(MATRIX_PROMPTS, GREEDY, use_tqdm=False)
    assert (len(replays) > 0) == (topk == 0)
    for out, ref in zip(got, want):
        assert out.token_ids == ref.token_ids
        got_lp = [t.logprob for t in out.logprobs]
        assert got_lp == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
