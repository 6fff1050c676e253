"""Vanilla: dense full attention, the baseline every method is compared with."""

from __future__ import annotations

from sparsevllm.sparse.base import SparseMethod
from sparsevllm.sparse.spec import MethodSpec


class Vanilla(SparseMethod):
    name = "vanilla"


SPEC = MethodSpec(
    name="vanilla",
    family="dense",
    description="full attention, the baseline",
    method=Vanilla,
    prefix_cache=True,
)
