"""RoPE on the CPU through a native kernel (sparsevllm/native/rope.c): q and k of a
layer in one call, with layers/rotary.py's rounding points (the same bits). `rope`
returns None where the kernel does not apply (no C compiler, another device or element
type, rows that are not contiguous); layers/rotary.py then computes it with torch."""

from __future__ import annotations

import ctypes

import torch

from sparsevllm.native.build import ELEMENT_TYPES, Argument, function

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# q and its strides, k and its strides, their type, positions, the cos and sin tables,
# tokens, the head counts, head_dim, the outputs, threads
_ARGS: list[Argument] = [
    _P,
    _I64,
    _I64,
    _P,
    _I64,
    _I64,
    _I32,
    _P,
    _P,
    _P,
    _I64,
    _I32,
    _I32,
    _I32,
    _P,
    _P,
    _I32,
]


def _kernel() -> ctypes._NamedFuncPointer | None:
    return function("rope", "svllm_rope", _ARGS, None)


def rope(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_position, D/2] float32
    sin: torch.Tensor,  # [max_position, D/2] float32
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotated q and k (new contiguous tensors), or None."""
    fn = _kernel()
    code = ELEMENT_TYPES.get(q.dtype)
    if fn is None or code is None or k.dtype != q.dtype or q.device.type != "cpu":
        return None
    if q.stride(2) != 1 or k.stride(2) != 1 or positions.dtype != torch.int64:
        return None
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        return None
    if cos.shape[-1] * 2 != q.shape[-1]:
        return None  # the tables are for another head_dim
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
