"""CPU linears of a compiled forward: float32 by row count (MKL's GEMV for a few rows,
oneDNN's packed GEMM for more), bfloat16 always over the packed weight.

`F.linear` in float32 on the CPU is MKL's sgemm. On the AMD EPYC (Zen 1, AVX2) the
engine was measured on, it ran 16-row products at 4-11 GFLOPS and the 16-row LM head at
half oneDNN's speed over a weight reordered once into oneDNN's blocked layout
(`layers/cpu_linear.py`'s packing, which bfloat16 models already use); at one row MKL was
as fast or faster. So a compiled model keeps both forms of its weights (`PackedWeights`)
and each float32 call picks by rows. bfloat16 `F.linear` reorders the plain weight on
every call (layers/cpu_linear.py), so bfloat16 calls always take the packed form.
It is one operator (`torch.ops.sparsevllm.linear`), so a compiled graph
(engine/cpu_compile.py) calls it as one node: Inductor cannot trace an opaque packed
weight, and the packed form is found from the dense weight it is given.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn.functional as F

from sparsevllm.layers.cpu_linear import Packed, pack_weight, packed_linear

# Rows from which a float32 call uses the packed oneDNN GEMM (fewer: MKL's, F.linear).
PACKED_MIN_ROWS = 4


class PackedWeights:
    """The packed forms of one model's weights, found by the dense weight's address and
    shape. Owned by the model's compiled forward, so they live and die with its weights
    (a process-wide table would keep them after the model is freed, and could hand a
    stale packed form to a new weight allocated at the same address)."""

    def __init__(self) -> None:
        self._packed: dict[tuple[int, tuple[int, ...]], Packed] = {}

    def add(self, weight: torch.Tensor) -> None:
        """Keep `weight` `[out, in]` (float32 or bfloat16, CPU) also in oneDNN's layout."""
        key = (weight.data_ptr(), tuple(weight.shape))
        if key not in self._packed:
            self._packed[key] = pack_weight(weight)

    def get(self, weight: torch.Tensor) -> Packed | None:
        return self._packed.get((weight.data_ptr(), tuple(weight.shape)))

    @contextmanager
    def active(self) -> Iterator[None]:
        """Let `linear` calls in the block use these packed forms."""
        _active.append(self)
        try:
            yield
        finally:
            _active.pop()


_active: list[PackedWeights] = []


# A plain operator definition, not `torch.library.custom_op`: the latter's Python
# wrapper cost ~30 us a call (measured on a 2-core AMD EPYC Zen 4: 89 against 62 us for
# a one-row 1728 x 576 bfloat16 product whose GEMM takes 56), and a decode step of the
# default model makes 121 of these calls.
_lib = torch.library.Library("sparsevllm", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, x `[N, in]` -> `[N, out]`, by the packed weight when
    the active PackedWeights holds one for `weight` (float32: from PACKED_MIN_ROWS rows)."""
    packed = _active[-1].get(weight) if _active else None
    few = x.dtype == torch.float32 and x.shape[0] < PACKED_MIN_ROWS
    if packed is None or few:
        return F.linear(x, weight, bias)
    return packed_linear(x.contiguous(), packed, bias)


_lib.impl("linear", _linear_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("sparsevllm::linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # [N, out]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The operator `torch.ops.sparsevllm.linear` (see `_linear_impl`)."""
    return cast(torch.Tensor, torch.ops.sparsevllm.linear(x, weight, bias))
