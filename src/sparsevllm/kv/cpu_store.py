"""Dense KV stores on the CPU through a native kernel (sparsevllm/native/kv_store.c): a
step's rows copied to their slots in one call. `store` returns False where the kernel
does not apply (no C compiler, another device, element type or layout); kv/dense.py then
stores with torch."""

from __future__ import annotations

import ctypes

import torch

from sparsevllm.native.build import Argument, function

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# k and its token stride (bytes), v and its, slots, tokens, the pool's slots, the pools
# and their slot strides (bytes), the row bytes of k and v
_ARGS: list[Argument] = [_P, _I64, _P, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64]


def _token_rows(t: torch.Tensor) -> bool:
    """Whether each token's `[H, D]` of `t` `[T, H, D]` is one contiguous run."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def store(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    slots: torch.Tensor,  # [T] slot ids, -1: not written
    k_pool: torch.Tensor,  # [num_slots, Hkv, D]
    v_pool: torch.Tensor,  # [num_slots, Hkv, Dv]
) -> bool:
    """Copy row t of k and v to slot `slots[t]` of the pools (none where a slot is past
    the pools: IndexError); False where not applied."""
    tensors = (k, v, slots, k_pool, v_pool)
    if any(t.device.type != "cpu" for t in tensors):
        return False
    if k.dtype != k_pool.dtype or v.dtype != v_pool.dtype or slots.dim() != 1:
        return False
    if k.shape[1:] != k_pool.shape[1:] or v.shape[1:] != v_pool.shape[1:]:
        return False
    if not all(_token_rows(t) for t in (k, v, k_pool, v_pool)):
        return False
    fn = function("kv_store", "svllm_kv_store", _ARGS, _I64)
    if fn is None:
        return False
    slots = slots.to(torch.int64).contiguous()
    ke, ve = k.element_size(), v.element_size()
    if slots.shape[0] != k.shape[0] or v.shape[0] != k.shape[0]:
        raise ValueError(f"{k.shape[0]} K rows, {v.shape[0]} V rows, {slots.shape[0]} slots")
    num_slots = min(k_pool.shape[0], v_pool.shape[0])
    bad = fn(
        k.data_ptr(), k.stride(0) * ke, v.data_ptr(), v.stride(0) * ve, slots.data_ptr(),
        slots.shape[0], num_slots, k_pool.data_ptr(), k_pool.stride(0) * ke,
        v_pool.data_ptr(), v_pool.stride(0) * ve, k.shape[1] * k.shape[2] * ke,
        v.shape[1] * v.shape[2] * ve,
    )  # fmt: skip
    if bad:
        slot = int(slots[bad - 1])
        raise IndexError(f"slot {slot} is out of range for a pool of {num_slots} slots")
    return True
