"""The gated MLP's `F.silu(gate) * up` on the CPU through a native kernel
(sparsevllm/native/silu_mul.c): one pass instead of two torch operators, with their
rounding points (bfloat16 results equal torch's; float32 ones to the last bit of e^-g).
`silu_mul` returns None where the kernel does not apply (no C compiler, another device,
float16, rows that are not contiguous); layers/mlp.py then computes the torch form."""

from __future__ import annotations

import ctypes

import torch

from sparsevllm.native.build import ELEMENT_TYPES, Argument, function

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# gate and its row stride, up and its row stride, out, rows, width, type, threads
_ARGS: list[Argument] = [_P, _I64, _P, _I64, _P, _I64, _I64, _I32, _I32]


def silu_mul(
    gate: torch.Tensor,  # [T, I]
    up: torch.Tensor,  # [T, I]
) -> torch.Tensor | None:  # [T, I] contiguous
    """`F.silu(gate) * up` (gate and up may be strided views of one GEMM's output), or
    None."""
    if gate.device.type != "cpu" or gate.dtype not in (torch.float32, torch.bfloat16):
        return None  # float16: the kernel's conversions were slower than torch's
    code = ELEMENT_TYPES[gate.dtype]
    fn = function("silu_mul", "svllm_silu_mul", _ARGS, None)
    if fn is None or up.dtype != gate.dtype:
        return None
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return None  # the kernel has no backward
    rows, width = gate.shape
    out = torch.empty(rows, width, dtype=gate.dtype)
    fn(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows,
        width, code, torch.get_num_threads(),
    )  # fmt: skip
    return out
