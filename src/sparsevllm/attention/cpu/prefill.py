"""Causal chunk attention over bfloat16 Q, K and V through the native AVX512-BF16 kernel
(sparsevllm/native/prefill_attention.c): the CPU backend's prefill chunks that need no
window, mask, scores or selection. `prefill_attention` returns None where the kernel does
not apply (no compiler or no AVX512-BF16, another dtype, head dims that are not
multiples of 32); the caller then takes the reference attention (SDPA)."""

from __future__ import annotations

import ctypes
import math

import torch

from sparsevllm.native.build import Argument, function

_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# q and its strides, k, v and their token stride, out, queries, keys, heads, head dim,
# scale, threads
_ARGS: list[Argument] = [_P, _I64, _I64, _P, _P, _I64, _P, _I32, _I32, _I32, _I32, _I32, _F32, _I32]
LOG2E = 1.0 / math.log(2.0)


def _supported() -> bool:
    fn = function("prefill_attention", "svllm_prefill_attention_supported", [], ctypes.c_int)
    return fn is not None and fn() == 1


def prefill_attention(
    q: torch.Tensor,  # [n, Hq, D]: the view's last n entries' queries
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,  # [L, Hkv, D]
    scale: float,
) -> torch.Tensor | None:  # [n, Hq, D]
    """`torch_ref.attend(q, k, v, scale)` (causal, no window or mask), or None."""
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (q, k, v)):
        return None
    n, num_q_heads, dim = q.shape
    length, num_kv_heads = k.shape[0], k.shape[1]
    if v.shape != k.shape or k.shape[2] != dim or dim % 32 or n < 2 or n > length:
        return None
    if num_q_heads % num_kv_heads or q.stride(2) != 1 or not _supported():
        return None
    if torch.is_grad_enabled() and q.requires_grad:
        return None  # the kernel has no backward
    k, v = _rows(k), _rows(v)
    if k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    fn = function("prefill_attention", "svllm_prefill_attention", _ARGS, _I32)
    assert fn is not None
    out = torch.empty(n, num_q_heads, dim, dtype=torch.bfloat16)
    status = fn(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
        out.data_ptr(), n, length, num_q_heads, num_kv_heads, dim, scale * LOG2E,
        torch.get_num_threads(),
    )  # fmt: skip
    if status == 1:
        raise MemoryError("the CPU prefill attention kernel could not allocate its buffers")
    return out if status == 0 else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` `[L, H, D]` with each token's heads one contiguous run (as the kernel reads)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()
