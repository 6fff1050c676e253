"""bfloat16 and float32 linears on the CPU through oneDNN, with weights reordered once.

A decode step on the CPU is bound by reading the weights. `F.linear` in bfloat16 hands
oneDNN a plain row-major weight, which it reorders into its blocked layout on every call:
on a 2-core AVX512-BF16 machine a SmolLM2-135M layer's GEMMs ran at 11-14 GB/s that way,
and the 49,152 x 576 LM head took 7 ms a token. Reordered once after loading
(`torch.ops.mkldnn._reorder_linear_weight`, the prepacking Inductor's CPU freezing does),
the same GEMMs run 1.4-2.6x faster at 1 to 256 rows, with the same results.

float32 `F.linear` goes to MKL's GEMV/GEMM over the plain weight. On an Intel Xeon
(AVX512, AMX) packing float32 weights measured no faster; on an AMD EPYC (Zen 4, 2
cores) one decode step's float32 layer GEMMs of SmolLM2-135M took 35.3 ms plain and
22.7 ms packed at one row (40.1 against 61.9 ms at 16 rows) and the LM head 9.8 against
4.6 ms: decode 17.2 -> 24.1 tokens/s end to end. So float32 is packed too.

The reorder takes the number of rows the GEMMs will see, and oneDNN picks its blocking
for it. float32 weights are packed for 16 rows: on an AMD EPYC (Zen 3, AVX2, 2 cores) a
decode step of the default model took 47.7 ms packed for 16 rows against 53.4 ms packed
for one (batch 1, medians of 4 interleaved runs), and 106-112 against 125-128 ms at batch
16 (the quieter two of four runs each); packed for one row the 3,072 x 576 gate/up GEMM
ran 1.4x and the LM head 1.3x slower at 16 rows. bfloat16 keeps the one-row packing it
was measured with (this machine cannot pack bfloat16).

The dense weights stay where they are (`state_dict()`, tied embeddings and MLA's
absorbed up-projections read them), so a packed model holds its linear weights twice.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from sparsevllm.layers import cpu_gemm
from sparsevllm.layers.cpu_gemm import GemmWeight


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed on this CPU: bfloat16 where the native
    kernel serves it (layers/cpu_gemm.py), or oneDNN is present and its reorder runs
    here (bfloat16 needs AVX512 BW/VL/DQ or AVX-NE-CONVERT; elsewhere the model keeps
    plain `F.linear`, which computes bf16 through float32)."""
    packable = dtype in (torch.bfloat16, torch.float32)
    if device.type != "cpu" or not packable:
        return False
    return cpu_gemm.serves(dtype) or _cpu_packs(dtype)


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        pack_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:  # "bf16 path needs the cpu support ..."
        return False
    return True


# The rows oneDNN's blocked layout is chosen for, per weight dtype (module docstring).
PACK_ROWS = {torch.float32: 16, torch.bfloat16: 1}


# A packed weight: the native kernel's layout, or oneDNN's (an opaque tensor).
Packed = GemmWeight | torch.Tensor


def pack_weight(weight: torch.Tensor) -> Packed:
    """`weight` `[out, in]` in the native bfloat16 kernel's layout where it applies,
    otherwise reordered into oneDNN's blocked layout."""
    if cpu_gemm.applies(weight):
        return cpu_gemm.pack(weight)
    rows = PACK_ROWS.get(weight.dtype, 1)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over `pack_weight(weight)`; `x` `[..., in]`."""
    # A step's [N, in] rows as they are: two reshapes cost ~2 us a call, ~120 calls a step.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [N, in]
    if isinstance(packed, GemmWeight):
        out = cpu_gemm.linear(flat, packed, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """An `nn.Linear` that computes over its packed weight. It keeps the linear's own
    `weight` and `bias` parameters, so parameter names and `state_dict()` are unchanged."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)
