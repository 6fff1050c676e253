"""Greedy sampling's argmax over float32 logits on the CPU through a native kernel
(sparsevllm/native/argmax.c): torch's CPU argmax compares element by element (0.5 ms
for 16 rows of 49,152 logits on a 2-core AMD EPYC, about 4% of a decode step there).
`argmax` returns None where the kernel does not apply (no C compiler, another device or
dtype, rows that are not contiguous); layers/sampler.py then calls torch's."""

from __future__ import annotations

import ctypes

import torch

from sparsevllm.native.build import Argument, function

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# logits, row stride, rows, width, out, threads
_ARGS: list[Argument] = [_P, _I64, _I64, _I64, _P, _I32]


def argmax(logits: torch.Tensor) -> torch.Tensor | None:  # [B] int64
    """`logits.argmax(dim=-1)` for `logits` `[B, V]` (ties and NaNs as torch resolves
    them: the first maximal index, a NaN above every number), or None."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        return None
    fn = function("argmax", "svllm_argmax_f32", _ARGS, None)
    if fn is None:
        return None
    rows, width = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn(logits.data_ptr(), logits.stride(0), rows, width, out.data_ptr(), torch.get_num_threads())
    return out
