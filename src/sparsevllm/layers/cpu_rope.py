"""RoPE on the CPU through a native kernel (sparsevllm/native/rope.c): q and k of a
layer in one call, with layers/rotary.py's rounding points (the same bits). `rope`
returns None where the kernel does not apply (no C compiler, another device or element
type, rows that are not contiguous); layers/rotary.py then computes it with torch."""

from __future__ import annotations

import ctypes

import torch

from sparsevllm.native.build import load

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _kernel() -> ctypes._NamedFuncPointer | None:
    lib = load("rope")
    if lib is None:
        return None
    fn = lib.svllm_rope
    if fn.argtypes is None:
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [p, i64, i64, p, i64, i64, i32, p, p, p, i64, i32, i32, i32, p, p, i32]
        fn.restype = None
    return fn


def rope(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_position, D/2] float32
    sin: torch.Tensor,  # [max_position, D/2] float32
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotated q and k (new contiguous tensors), or None."""
    fn = _kernel()
    code = _DTYPES.get(q.dtype)
    if fn is None or code is None or k.dtype != q.dtype or q.device.type != "cpu":
        return None
    if q.stride(2) != 1 or k.stride(2) != 1 or positions.dtype != torch.int64:
        return None
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return None  # the kernel has no backward
    tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype)
    k_out = torch.empty(k.shape, dtype=k.dtype)
    positions = positions.contiguous()
    fn(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), code,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, num_q_heads, k.shape[1],
        head_dim, q_out.data_ptr(), k_out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out
