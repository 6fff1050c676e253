"""The KV store kernel: each new token's K/V lands in its slot, padding rows write nothing."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, INTERPRET, require_triton

require_triton()

from sparsevllm.attention.triton import store_kv  # noqa: E402


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("heads_dim", [(2, 64), (8, 128)])
def test_store_kv(cache_dtype, index_dtype, heads_dim):
    num_kv_heads, head_dim = heads_dim
    num_tokens, num_slots = 19, 50
    gen = torch.Generator().manual_seed(7)
    # k and v as strided slices of one fused buffer, like a QKV projection's output.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[[3, 11]] = -1  # padding rows
    slots = slots.to(index_dtype).to(DEVICE)
    k_cache = (
        torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    )
    v_cache = (
        torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(cache_dtype).to(DEVICE)
    )
    k_before, v_before = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    valid = slots >= 0
    written = slots[valid].long()
    # The interpreter rounds fp32 -> bf16 toward zero, a GPU to nearest: allow one ulp there.
    rtol = 2**-7 if INTERPRET and cache_dtype != torch.float32 else 0.0
    torch.testing.assert_close(k_cache[written], k[valid].to(cache_dtype), rtol=rtol, atol=0)
    torch.testing.assert_close(v_cache[written], v[valid].to(cache_dtype), rtol=rtol, atol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])
