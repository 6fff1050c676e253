"""The block-sparse prefill kernel and the estimation pass vs attention/sparse_prefill.py
(the torch reference), on CUDA or under the Triton interpreter (small shapes)."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention import sparse_prefill as sp  # noqa: E402
from sparsevllm.attention.triton import prefill_attention  # noqa: E402
from sparsevllm.attention.triton.prefill_sparse import (  # noqa: E402
    block_mass,
    prefill_sparse_attention,
)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_view(length: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """Caches over permuted slots (slot 0: NaN, so a read past the view poisons the
    output) and the view's table row."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = length + 29
    k_cache = torch.randn(num_slots, hkv, d, generator=gen)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen)
    k_cache[0] = v_cache[0] = float("nan")
    table_row = torch.zeros(length + 7, dtype=torch.int32)
    table_row[:length] = (torch.randperm(num_slots - 1, generator=gen)[:length] + 1).int()
    return (k_cache.to(dtype).to(DEVICE), v_cache.to(dtype).to(DEVICE), table_row.to(DEVICE))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_lists(hkv: int, q_len: int, length: int, bm: int, bn: int, keep: float, seed: int):
    """Random ascending block lists that hold each query block's diagonal tiles (what the
    kernel requires), as block_count / block_index."""
    gen = torch.Generator().manual_seed(seed)
    num_qb, num_kb = -(-q_len // bm), -(-length // bn)
    qb = torch.arange(num_qb)
    first = length - q_len + qb * bm
    last = length - q_len + torch.clamp((qb + 1) * bm, max=q_len) - 1
    kb = torch.arange(num_kb)
    diag = (kb[None, :] >= (first // bn * bn)[:, None] // bn) & (
        kb[None, :] <= (last // bn)[:, None]
    )
    mask = torch.rand(hkv, num_qb, num_kb, generator=gen) < keep
    mask = (mask | diag[None]) & (kb[None, :] <= (last // bn)[:, None])[None]
    count, index = sp._compact(mask, num_kb)
    return count.to(DEVICE), index.to(DEVICE)


def check_kernel(heads, prefix, q_len, bm, bn, dtype, count_index, d=32, seed=0):
    hq, hkv = heads
    length = prefix + q_len
    k_cache, v_cache, table_row = make_view(length, hkv, d, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(q_len, hq, d, generator=gen).to(dtype).to(DEVICE)
    count, index = count_index(q, k_cache, table_row)
    out = torch.full_like(q, float("nan"))
    prefill_sparse_attention(
        q, k_cache, v_cache, table_row, length, 0.2, count, index, out, block_m=bm, block_n=bn
    )
    assert torch.isfinite(out).all()
    view = table_row[:length].long()
    ref = sp.attend_block_sparse(
        q.double(), k_cache[view].double(), v_cache[view].double(), 0.2, count, index, bm, bn
    )
    assert rel_err(out, ref) < TOL[dtype]
    return out, ref


@pytest.mark.parametrize(
    "heads,prefix,q_len,bm,bn,keep",
    [
        ((4, 2), 0, 70, 16, 16, 0.3),  # a whole prompt, ragged last block
        ((4, 2), 37, 50, 32, 16, 0.5),  # a cached prefix off the tile grid
        ((2, 2), 64, 64, 32, 16, 0.0),  # MHA, only the diagonals
        ((8, 2), 5, 33, 16, 16, 1.0),  # every causal block
        ((4, 1), 100, 40, 32, 16, 0.2),
    ],
)
def test_kernel_matches_masked_reference(heads, prefix, q_len, bm, bn, keep):
    hkv = heads[1]

    def lists(q, k_cache, table_row):
        return random_lists(hkv, q_len, prefix + q_len, bm, bn, keep, seed=q_len)

    check_kernel(heads, prefix, q_len, bm, bn, torch.float32, lists)


@pytest.mark.parametrize("d", [64, 128, 256])  # 256: Gemma 3's heads (2 pipeline stages)
def test_kernel_bf16_production_tiles(d):
    cfg = sp.PrefillSparsity(1, 2, 1, 16)

    def lists(q, k_cache, table_row):
        return random_lists(2, 130, 450, cfg.block_m, cfg.block_n, 0.2, seed=3)

    check_kernel((4, 2), 320, 130, cfg.block_m, cfg.block_n, torch.bfloat16, lists, d=d)


def test_covering_lists_equal_dense_prefill():
    prefix, q_len, bm, bn = 30, 90, 32, 16
    length = prefix + q_len
    k_cache, v_cache, table_row = make_view(length, 2, 32, torch.float32, 5)
    q = torch.randn(q_len, 4, 32).to(DEVICE)
    cfg = sp.PrefillSparsity(1, 100, 100, 8, block_m=bm, block_n=bn)
    mass = block_mass(q[-8:], k_cache, table_row, length, 0.2, bn)
    count, index = sp.select_blocks(mass, q_len, length, cfg)
    sparse = torch.empty_like(q)
    prefill_sparse_attention(
        q, k_cache, v_cache, table_row, length, 0.2, count, index, sparse, block_m=bm, block_n=bn
    )
    dense = torch.empty_like(q)
    rows = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    prefill_attention(q, k_cache, v_cache, table_row[None], rows, starts, lens, 0.2, dense, q_len)
    assert rel_err(sparse, dense) < 1e-5


@pytest.mark.parametrize("heads,r,length,bn", [((4, 2), 8, 150, 16), ((2, 2), 70, 90, 32)])
def test_block_mass_matches_reference(heads, r, length, bn):
    hq, hkv = heads
    k_cache, _, table_row = make_view(length, hkv, 32, torch.float32, 7)
    q = torch.randn(r, hq, 32).to(DEVICE)
    got = block_mass(q, k_cache, table_row, length, 0.3, bn)
    ref = sp.block_mass_reference(q, k_cache[table_row[:length].long()], 0.3, bn)
    assert got.shape == ref.shape == (hkv, r, -(-length // bn))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_estimated_selection_through_the_kernel():
    # The whole path as the backend runs it: estimation pass, selection, sparse kernel.
    cfg = sp.PrefillSparsity(1, 2, 1, 8, block_m=16, block_n=16)

    def lists(q, k_cache, table_row):
        mass = block_mass(q[-cfg.last_q :], k_cache, table_row, 140, 0.2, cfg.block_n)
        return sp.select_blocks(mass, q.shape[0], 140, cfg)

    counts = []

    def kept(q, k_cache, table_row):
        counts.append(lists(q, k_cache, table_row))
        return counts[-1]

    check_kernel((4, 2), 60, 80, 16, 16, torch.float32, kept)
    assert sp.density(counts[0][0].cpu(), 80, 140, cfg) < 0.9  # it did skip blocks


@pytest.mark.parametrize("heads,q_len", [((4, 1), 5), ((4, 1), 16), ((4, 2), 16)])
def test_short_last_chunk_over_a_long_view(heads, q_len):
    # A prompt's short last chunk after full-size ones, one KV head (Gemma-3-270M): the
    # estimated count is [1, 1], a view of the selection's cumulative sums whose size-1
    # last dimension keeps a stride other than 1, which the launcher must accept (the
    # H100 quality run at 4K failed there).
    cfg = sp.PrefillSparsity(1, 2, 1, 4, block_m=16, block_n=16)

    def lists(q, k_cache, table_row):
        mass = block_mass(q[-cfg.last_q :], k_cache, table_row, 200 + q_len, 0.2, cfg.block_n)
        count, index = sp.select_blocks(mass, q.shape[0], 200 + q_len, cfg)
        assert count.shape == (heads[1], 1)
        return count, index

    check_kernel(heads, 200, q_len, 16, 16, torch.float32, lists)


def test_engine_sparse_prefill_matches_the_reference_backend(tiny_model_factory, monkeypatch):
    """The Triton backend in the engine (estimation pass, selection, sparse kernel, the
    dense kernel for the batch's other sequence) gives the torch backend's tokens."""
    from sparsevllm import LLM, SamplingParams
    from sparsevllm.attention import triton_backend
    from sparsevllm.engine import runner as runner_module

    model = tiny_model_factory("llama4")
    prompts = [[1] + [(29 * i + 5) % 240 + 3 for i in range(330)], [1, 7, 8, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    knobs = dict(
        dtype="float32",
        enforce_eager=True,
        prefill_sparse_method="vertical_slash",
        prefill_sparse_min_len=256,
        prefill_sparse_vertical_blocks=1,
        prefill_sparse_slash_blocks=0,
    )
    ref = LLM(model, device="cpu", **knobs).generate(prompts, greedy, use_tqdm=False)
    sparse_seqs = []
    original = triton_backend.TritonBackend._sparse_prefill

    def spy(self, layer, q, batch, scale, out, i):
        sparse_seqs.append((batch.num_seqs, i))
        return original(self, layer, q, batch, scale, out, i)

    monkeypatch.setattr(triton_backend.TritonBackend, "_sparse_prefill", spy)
    monkeypatch.setattr(runner_module, "default_backend_name", lambda device: "triton")
    llm = LLM(model, device=DEVICE.type, kv_cache_memory_gb=1, **knobs)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert sparse_seqs == [(2, 0)] * 4  # the long prompt, in one batch with the short one
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
