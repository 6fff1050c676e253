"""The CPU backend's native decode kernel (attention/cpu/): equal to the reference
attention over gathered views, in every element type and shape it takes; the engine's
greedy tokens equal the reference backend's; without a compiler the backend is the
reference."""

from __future__ import annotations

import pytest
import torch

from native_env import HAS_C_COMPILER
from native_env import needs_c_compiler as needs_kernel
from sparsevllm import LLM, SamplingParams
from sparsevllm.attention import backend, torch_ref
from sparsevllm.attention.cpu import decode
from sparsevllm.config import ATTENTION_BACKENDS
from sparsevllm.native import build as native
from tiny_gemma3 import save_tiny_gemma3


def test_the_kernel_builds_where_a_compiler_exists():
    if HAS_C_COMPILER:
        assert decode.available()
    else:
        assert not decode.available()


def _case(s, hq, hkv, d, dv, dtype, lens, window=None, seed=0):
    """A pool of scattered slots, views past whose ends the table holds garbage ids,
    and table rows that are not the sequences' order."""
    g = torch.Generator().manual_seed(seed)
    width, num_slots = max(lens) + 3, s * (max(lens) + 3) + 7
    k = torch.randn(num_slots, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_slots, hkv, dv, generator=g).to(dtype)
    table = torch.full((s + 2, width), num_slots - 1, dtype=torch.int32)
    perm = torch.randperm(num_slots - 1, generator=g).to(torch.int32)
    rows = torch.randperm(s + 2, generator=g)[:s].to(torch.int32)
    for i, n in enumerate(lens):
        table[rows[i], :n] = perm[i * width : i * width + n]
    q = torch.randn(s, hq, d, generator=g).to(dtype)
    return q, k, v, table, rows, torch.tensor(lens, dtype=torch.int32)


def _reference(q, k, v, table, rows, lens, scale, window):
    outs = []
    for i in range(q.shape[0]):
        view = table[rows[i], : lens[i]].long()
        ki, vi = k[view].double(), v[view].double()
        outs.append(torch_ref.attend(q[i : i + 1].double(), ki, vi, scale, window))
    return torch.cat(outs)  # [S, Hq, Dv]


@needs_kernel
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize(
    "shape",
    [
        (4, 9, 3, 64, 64),  # the default model's heads: the head_dim-64 path
        (2, 8, 2, 128, 128),  # Llama's: the head_dim-128 path
        (3, 4, 4, 16, 16),  # no GQA, the generic path
        (2, 6, 2, 48, 32),  # value_dim != head_dim
    ],
)
@pytest.mark.parametrize("window", [None, 7])
def test_kernel_equals_reference(dtype, tol, shape, window):
    s, hq, hkv, d, dv = shape
    lens = [1, 300, 45, 2][:s]  # 300: views split across threads (> 64 keys a split)
    q, k, v, table, rows, lens_t = _case(s, hq, hkv, d, dv, dtype, lens, window)
    got = decode.decode_attention(q, k, v, table, rows, lens_t, max(lens), 0.3, window)
    assert got is not None and got.dtype == dtype and got.shape == (s, hq, dv)
    want = _reference(q, k, v, table, rows, lens_t, 0.3, window)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)


@needs_kernel
def test_kernel_reads_float32_queries_over_16_bit_pools():
    """bfloat16 KV under float32 compute (`kv_cache_dtype="bfloat16"`)."""
    q, k, v, table, rows, lens = _case(2, 4, 2, 32, 32, torch.bfloat16, [30, 70])
    q = q.float() + 0.01
    got = decode.decode_attention(q, k, v, table, rows, lens, 70, 0.2)
    assert got is not None and got.dtype == torch.float32
    want = _reference(q, k, v, table, rows, lens, 0.2, None)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_splits_give_enough_items_and_split_long():
    assert decode.num_splits(16, 300) == 1  # 16 sequences: 16 items
    assert decode.num_splits(2, 10_000) == 8  # two sequences, 8 splits each
    assert decode.num_splits(1, 300) == 4  # capped at MIN_SPLIT_KEYS keys a split
    assert decode.num_splits(1, 100) == 1


def test_tensors_the_kernel_does_not_read_give_none():
    q, k, v, table, rows, lens = _case(2, 4, 2, 16, 16, torch.float32, [5, 9])
    i8 = k.to(torch.int8)
    assert decode.decode_attention(q, i8, i8, table, rows, lens, 9, 0.2) is None
    wide = table.long()
    assert decode.decode_attention(q, k, v, wide, rows, lens, 9, 0.2) is None
    strided = torch.randn(k.shape[0], 2, 32)[:, :, :16]  # rows not one contiguous run
    assert decode.decode_attention(q, strided, strided, table, rows, lens, 9, 0.2) is None


def test_without_a_compiler_the_backend_is_the_reference(monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    native.load.cache_clear()
    try:
        assert not decode.available()
        q, k, v, table, rows, lens = _case(1, 4, 2, 16, 16, torch.float32, [5])
        assert decode.decode_attention(q, k, v, table, rows, lens, 5, 0.2) is None
    finally:
        native.load.cache_clear()


PROMPTS = [[5, 17, 33, 9, 81, 12, 40], [7, 7, 100, 3], list(range(10, 60))]


def _greedy(model: str, backend: str, **kwargs):
    llm = LLM(model, device="cpu", kv_cache_memory_gb=0.02, attention_backend=backend, **kwargs)
    assert llm.engine.runner.backend.name == backend
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    single = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    return batched + single


@needs_kernel
@pytest.mark.parametrize(
    "model_kind,kwargs",
    [
        ("llama", {}),
        ("llama_hd64", {}),
        ("llama", {"kv_cache_dtype": "bfloat16"}),
        ("gemma3", {}),  # sliding-window layers
        ("llama", {"sparse_method": "streamingllm", "decode_keep_tokens": 40}),
    ],
)
def test_engine_tokens_equal_the_reference_backends(
    model_kind, kwargs, tiny_model_factory, tmp_path
):
    if model_kind == "gemma3":
        model = save_tiny_gemma3(tmp_path / "gemma3")
    else:
        model = tiny_model_factory(model_kind)
    want = _greedy(model, "torch", **kwargs)
    got = _greedy(model, "cpu", **kwargs)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp_w = [t.logprob for t in w.outputs[0].logprobs]
        lp_g = [t.logprob for t in g.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(lp_g), torch.tensor(lp_w), atol=1e-4, rtol=0)


def test_the_settings_backends_are_the_registered_ones():
    assert set(ATTENTION_BACKENDS) == {"auto", *backend._BACKENDS}


def test_attention_backend_is_a_setting(tiny_llama):
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory_gb=0.02, attention_backend="torch")
    assert llm.engine.runner.backend.name == "torch"
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory_gb=0.02)
    assert llm.engine.runner.backend.name == "cpu"  # auto on the CPU
    with pytest.raises(ValueError, match="runs on cuda devices.*use auto, cpu, torch"):
        LLM(tiny_llama, device="cpu", kv_cache_memory_gb=0.02, attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_llama, device="cpu", attention_backend="flash")


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    # The splits of a view (the order of its sums) come from the shapes alone: engines of
    # one process that picked different thread counts give the same bits.
    q, k, v, table, rows, lens = _case(3, 9, 3, 64, 64, torch.bfloat16, [700, 90, 1000])
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(decode.decode_attention(q, k, v, table, rows, lens, 1000, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
