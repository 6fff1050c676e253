"""One GEMM for projections that read the same input (q/k/v, gate/up).

At decode a layer's matmuls are weight-bandwidth bound, and small ones (k_proj and
v_proj are a quarter of q_proj under GQA) reach less of the bandwidth than one large
one; fused, a layer runs 4 GEMMs instead of 7. The parameters keep their Hugging Face
names: on `fuse()` (after loading) each projection's weight (and bias) becomes a view
into the fused tensor, so `state_dict()` and a later `load_state_dict()` still see and
update `q_proj.weight` and the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.layers.cpu_linear import Packed, PackedLinear, pack_weight, packed_linear


class Projections:
    """`linears` (same input features) applied to one input: one by one until `fuse()`,
    then by a single GEMM over their concatenated weights."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None  # [sum(out), in] once fused
        self.bias: torch.Tensor | None = None
        self.packed: Packed | None = None  # `weight` packed for the CPU's GEMMs

    def fuse(self) -> None:
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in self.linears])
            if self.linears[0].bias is not None:
                self.bias = torch.cat([lin.bias for lin in self.linears])
            start = 0
            for lin, n in zip(self.linears, self.sizes):
                lin.weight = nn.Parameter(self.weight[start : start + n], requires_grad=False)
                if self.bias is not None:
                    lin.bias = nn.Parameter(self.bias[start : start + n], requires_grad=False)
                start += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`x` `[T, in]` -> one `[T, out_i]` tensor per projection (fused: strided views)."""
        if self.weight is None:
            return tuple(lin(x) for lin in self.linears)
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias).split(self.sizes, dim=-1)
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> None:
    """Fuse every `Projections` of the model's modules. Call it once the model is on its
    final device and dtype (weights may be loaded afterwards: they are copied into the
    views): moving the model afterwards would separate the parameters from the fused
    tensors."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Projections) and value.weight is None:
                value.fuse()


def pack_linears(model: nn.Module) -> int:
    """Pack (`layers/cpu_linear.py`) every fused `Projections` and every other
    `nn.Linear` of a loaded, fused CPU model; returns how many weights."""
    fused: set[int] = set()
    count = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Projections) and value.weight is not None:
                value.packed = pack_weight(value.weight)
                fused.update(id(lin) for lin in value.linears)
                count += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # A fused projection's own linears are never called (their weights are views).
            if type(child) is nn.Linear and id(child) not in fused:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Undo `pack_linears`: plain `nn.Linear`s over the same weights and no packed
    copies (a compiled CPU forward traces plain linears; engine/cpu_compile.py)."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Projections):
                value.packed = None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(
                    child.in_features, child.out_features, bias=child.bias is not None,
                    device="meta",
                )  # fmt: skip
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
