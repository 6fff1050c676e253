"""bfloat16 linears on CPUs with AVX512-BF16 through a native kernel
(sparsevllm/native/gemm_bf16.c), over weights packed once after loading.

On a 2-core AMD EPYC (Zen 4, AVX512-BF16, no AMX) one decode step's linears of the
default model (30 layers and the LM head, 269 MB of bfloat16 weights) took 6.5 ms at one
row against oneDNN's 13.2 (`layers/cpu_linear.py`'s packed form), 13.6 against 17.8 at
16 rows, and as long as oneDNN at 4,096 rows (a prefill chunk). On processors with AMX
the kernel takes up to AMX_MAX_ROWS rows (a decode step's) and larger products go to
`F.linear` over the dense weight, where oneDNN's AMX kernels compute them (no copy of
the weight in oneDNN's layout is kept; neither choice was measured on an AMX machine).
The kernel is used where this module `applies`; elsewhere `layers/cpu_linear.py` keeps
oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsevllm.native.build import ELEMENT_TYPES, Argument, cpu_flags, function

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# x, its row stride, rows, the packed weight, out and in features, bias, its type, out,
# its row stride, its type, threads
_GEMM_ARGS: list[Argument] = [_P, _I64, _I64, _P, _I64, _I64, _P, _I32, _P, _I64, _I32, _I32]


# Rows up to which AMX processors use this kernel (module docstring).
AMX_MAX_ROWS = 16


@dataclass(frozen=True)
class GemmWeight:
    """A `[out_features, in_features]` bfloat16 weight in the kernel's blocked layout;
    on AMX processors also the dense weight (the same tensor, not a copy) for products
    of more than AMX_MAX_ROWS rows."""

    data: torch.Tensor  # [padded elements] bfloat16, opaque
    out_features: int
    in_features: int
    dense: torch.Tensor | None = None


@functools.cache
def _supported() -> bool:
    fn = function("gemm_bf16", "svllm_gemm_bf16_supported", [], ctypes.c_int)
    return fn is not None and fn() == 1


def serves(dtype: torch.dtype) -> bool:
    """Whether the kernel serves CPU weights of `dtype`: bfloat16 on a processor with
    AVX512-BF16 (where this build has it)."""
    return dtype == torch.bfloat16 and _supported()


def applies(weight: torch.Tensor) -> bool:
    """Whether `weight` `[out, in]` is served by the kernel: `serves` its dtype, on the
    CPU, with an even number of input features."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % 2:
        return False
    return serves(weight.dtype)


def _amx() -> bool:
    return "amx_bf16" in cpu_flags()


def pack(weight: torch.Tensor) -> GemmWeight:
    """`weight` `[out, in]` (where `applies`) in the kernel's layout."""
    n, k = weight.shape
    size = function("gemm_bf16", "svllm_gemm_bf16_packed_size", [_I64, _I64], _I64)
    pack_fn = function("gemm_bf16", "svllm_gemm_bf16_pack", [_P, _I64, _I64, _I64, _P], None)
    assert size is not None and pack_fn is not None, "pack() where applies() is false"
    w = weight.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
    data = torch.empty(size(n, k), dtype=torch.bfloat16)
    pack_fn(w.data_ptr(), w.stride(0), n, k, data.data_ptr())
    return GemmWeight(data, n, k, weight.detach() if _amx() else None)


def linear(x: torch.Tensor, weight: GemmWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for `x` `[N, in]` bfloat16 -> `[N, out]` bfloat16, where
    `weight = pack(w)`; the bias (bfloat16 or float32) is added before the rounding."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the bfloat16 kernel got a {x.dtype} input")
    if weight.dense is not None and x.shape[0] > AMX_MAX_ROWS:
        return F.linear(x, weight.dense, bias)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape[0], weight.out_features
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if bias is not None and (
        bias.stride(0) != 1 or bias.dtype not in (torch.float32, torch.bfloat16)
    ):
        bias = bias.to(torch.float32).contiguous()
    fn = function("gemm_bf16", "svllm_gemm_bf16", _GEMM_ARGS, _I32)
    assert fn is not None
    fn(
        x.data_ptr(), x.stride(0), rows, weight.data.data_ptr(), n, weight.in_features,
        None if bias is None else bias.data_ptr(),
        ELEMENT_TYPES[bias.dtype] if bias is not None else 0, out.data_ptr(), out.stride(0),
        ELEMENT_TYPES[torch.bfloat16], torch.get_num_threads(),
    )  # fmt: skip
    return out
