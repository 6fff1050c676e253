"""The CPU backend's native prefill kernel (attention/cpu/prefill.py): causal chunks over
bfloat16 Q, K and V against float64 attention of the same values (and as close as
SDPA), GQA groups and cached prefixes; which chunks it takes; and the engine's bfloat16
prefill through it against the reference backend's."""

from __future__ import annotations

import pytest
import torch

from sparsevllm import LLM
from sparsevllm.attention import torch_ref
from sparsevllm.attention.cpu import prefill

BF16 = torch.bfloat16
probe = torch.zeros(2, 1, 32, dtype=BF16)
serves = prefill.prefill_attention(probe, probe, probe, 1.0) is not None
needs_kernel = pytest.mark.skipif(not serves, reason="no AVX512-BF16 kernel on this CPU")


def _qkv(n, length, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).to(BF16)
    k = torch.randn(length, hkv, d, generator=g).to(BF16)
    v = torch.randn(length, hkv, d, generator=g).to(BF16)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize(
    "n,length,hq,hkv,d",
    [
        (256, 256, 9, 3, 64),  # the default model's heads, a whole prompt
        (37, 100, 4, 2, 128),  # a chunk after a cached prefix
        (2, 2, 1, 1, 32),
        (33, 33, 6, 1, 96),  # one KV head, blocks that do not divide the chunk
        (70, 300, 2, 2, 256),
    ],
)
def test_kernel_equals_float64_attention(n, length, hq, hkv, d):
    q, k, v = _qkv(n, length, hq, hkv, d, seed=n + d)
    scale = d**-0.5
    got = prefill.prefill_attention(q, k, v, scale)
    assert got is not None and got.shape == (n, hq, d) and got.dtype == BF16
    want = torch_ref.attend(q.double(), k.double(), v.double(), scale)
    sdpa = torch_ref.attend(q, k, v, scale)
    # float32 sums and softmax, one bfloat16 rounding of the outputs: as close as SDPA.
    err, sdpa_err = (got.double() - want).abs().max(), (sdpa.double() - want).abs().max()
    assert err <= max(1.05 * sdpa_err, 2**-8), (err, sdpa_err)


@needs_kernel
def test_kernel_reads_strided_queries_and_views():
    q, k, v = _qkv(20, 40, 4, 2, 64, seed=1)
    wide_q = torch.zeros(20, 6, 64, dtype=BF16)
    wide_q[:, 1:5] = q
    got = prefill.prefill_attention(wide_q[:, 1:5], k, v, 0.125)
    assert torch.equal(got, prefill.prefill_attention(q, k, v, 0.125))
    kv = torch.stack([k, v], dim=1)  # [L, 2, Hkv, D]: k and v views share a token stride
    assert torch.equal(prefill.prefill_attention(q, kv[:, 0], kv[:, 1], 0.125), got)


def test_chunks_the_kernel_does_not_take():
    q, k, v = _qkv(4, 8, 2, 1, 32, seed=2)
    assert prefill.prefill_attention(q.float(), k.float(), v.float(), 0.1) is None
    assert prefill.prefill_attention(q[:1], k, v, 0.1) is None  # decode: the other kernel
    q48, k48, v48 = _qkv(4, 8, 2, 1, 48, seed=3)
    assert prefill.prefill_attention(q48, k48, v48, 0.1) is None  # head dim not 32k
    assert prefill.prefill_attention(q, k[:3], v[:3], 0.1) is None  # more queries than keys


@needs_kernel
@pytest.mark.parametrize("chunk", [None, 16])
def test_engine_bfloat16_prefill_equals_the_reference_backend(tiny_model_factory, chunk):
    model = tiny_model_factory("llama_hd64")
    prompt = list(range(3, 90))
    kwargs = {} if chunk is None else {"chunk_prefill_size": chunk}
    logits = {}
    for backend in ("torch", "cpu"):
        llm = LLM(model, dtype="bfloat16", attention_backend=backend, **kwargs)
        logits[backend] = llm.prompt_logits(prompt).float()
    want, got = logits["torch"], logits["cpu"]
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
