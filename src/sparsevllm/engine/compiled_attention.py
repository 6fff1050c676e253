"""Attention as one opaque operator, for a forward that `torch.compile` traces whole.

The attention backends loop on the host, read the step's `ForwardBatch` (host lists, slot
tables, a sparse method's requests) and store K/V as a side effect: nothing a compiler
can trace. Registered as an operator (`torch.ops.sparsevllm.attention`), the call
is one node in the compiled graph; the operator finds the step's batch where the caller
put it (`step_batch`), so the graph's inputs stay plain tensors. This is how a compiled
CPU forward (engine/cpu_compile.py) keeps every backend and sparse method working.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import torch

from sparsevllm.attention.backend import ForwardBatch

_current: list[ForwardBatch] = []  # the batch of the forward in progress (a stack of one)


@contextmanager
def step_batch(batch: ForwardBatch) -> Iterator[None]:
    """Make `batch` the one that `attention` calls serve while the block runs."""
    _current.append(batch)
    try:
        yield
    finally:
        _current.pop()


# A plain operator definition rather than `torch.library.custom_op`, whose Python
# wrapper costs ~30 us a call (engine/cpu_linear_op.py).
_lib = torch.library.Library("sparsevllm", "FRAGMENT")
_lib.define("attention(Tensor q, Tensor k, Tensor v, Tensor layer, float scale) -> Tensor")


def _attention_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    """`batch.backend.forward(layer, q, k, v, batch, scale)` for the current step's batch:
    q `[T, Hq, D]`, k `[T, Hkv, D]`, v `[T, Hkv, Dv]` -> `[T, Hq, Dv]`. It stores k and v
    into the KV pool (a side effect the graph does not see: each layer's call depends on
    the previous layer's output, so the calls keep their order). `layer` is a 0-d int64
    tensor, not an int: one compiled decoder layer then serves every layer (Dynamo would
    specialise the graph on an int's value)."""
    batch = _current[-1]
    out = batch.backend.forward(int(layer), q, k, v, batch, scale)
    # An operator's output may not alias its inputs; the backends return fresh tensors,
    # but a reshape of one may be a view of a scratch buffer they reuse.
    return out.contiguous()


_lib.impl("attention", _attention_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("sparsevllm::attention")
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])  # [T, Hq, Dv]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float
) -> torch.Tensor:
    """The operator `torch.ops.sparsevllm.attention` (see `_attention_impl`)."""
    return cast(torch.Tensor, torch.ops.sparsevllm.attention(q, k, v, layer, scale))
