"""Dense KV stores on the CPU through the native kernel (kv/cpu_store.py): the rows the
torch path writes, unwritten rows (-1) skipped, strided rows of a fused projection,
out-of-range slots refused before anything is written, and the fallbacks."""

from __future__ import annotations

import pytest
import torch
from tests.native_env import needs_c_compiler

from sparsevllm.kv.cpu_store import store
from sparsevllm.kv.dense import DenseStorage


def _fused(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the strided views a fused q/k/v projection gives: [T, 2, 16] each."""
    qkv = torch.randn(tokens, 4 * 16 + 2 * 2 * 16).to(dtype)
    k = qkv[:, 64:96].view(tokens, 2, 16)
    v = qkv[:, 96:].view(tokens, 2, 16)
    return k, v


@needs_c_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_store_writes_what_index_copy_writes(dtype):
    torch.manual_seed(0)
    k, v = _fused(6, dtype)
    slots = torch.tensor([4, -1, 0, 11, 7, -1], dtype=torch.int32)
    got_k, got_v = torch.zeros(12, 2, 16, dtype=dtype), torch.zeros(12, 2, 16, dtype=dtype)
    assert store(k, v, slots, got_k, got_v)
    keep = slots >= 0
    want_k, want_v = torch.zeros_like(got_k), torch.zeros_like(got_v)
    want_k.index_copy_(0, slots[keep].long(), k[keep])
    want_v.index_copy_(0, slots[keep].long(), v[keep])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@needs_c_compiler
def test_out_of_range_slots_write_nothing():
    k, v = _fused(3, torch.float32)
    pool_k, pool_v = torch.zeros(5, 2, 16), torch.zeros(5, 2, 16)
    with pytest.raises(IndexError, match="slot 5 is out of range for a pool of 5"):
        store(k, v, torch.tensor([0, 1, 5]), pool_k, pool_v)
    assert not pool_k.any() and not pool_v.any()


def test_other_layouts_fall_back_and_the_storage_still_stores():
    k, v = _fused(2, torch.float32)
    bf16_pool = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    assert not store(k, v, torch.tensor([0, 1]), bf16_pool, bf16_pool.clone())
    heads_apart = torch.zeros(4, 16, 2).transpose(1, 2)  # [4, 2, 16], heads not one run
    assert not store(k, v, torch.tensor([0, 1]), heads_apart, heads_apart.clone())
    storage = DenseStorage.wrap(bf16_pool, bf16_pool.clone())
    storage.store(k, v, torch.tensor([2, -1]))
    assert torch.equal(storage.k[2], k[0].bfloat16()) and not storage.k[[0, 1, 3]].any()
