"""Single-query (decode) attention over a token-slot KV pool on the CPU, reading K and V
in place through the slot table (decode_attention.c), instead of copying every view out
of the pool and padding the batch for SDPA.

`decode_attention` returns None where the native kernel does not apply (no compiler, a
tensor off the CPU or of an element type the kernel does not read); the caller then
takes its torch path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from sparsevllm.native.build import ELEMENT_TYPES, Argument, function

# Keys per split of a view at least: below that a split's fixed cost outweighs the
# parallelism it adds.
MIN_SPLIT_KEYS = 64
# Work items a step aims for: every thread of an 8-thread process twice over. A fixed
# number rather than one from the threads in use: the splits set the order of a view's
# sums, and an engine's outputs must not change with its thread count (engines of one
# process can pick different counts, from the cores other processes keep busy).
TARGET_ITEMS = 16
LOG2E = math.log2(math.e)


_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# q, its type and strides, the scale; K, V, their type and slot strides; the table, its
# row stride, rows, lens, out; then the sizes, window, splits and threads.
_ARGS: list[Argument] = [_P, _I32, _I64, _I64, _F32, _P, _P, _I32, _I64, _I64, _P, _I64, _P, _P, _P]
_ARGS += [_I32] * 9


def _kernel() -> ctypes._NamedFuncPointer | None:
    return function("decode_attention", "svllm_decode_attention", _ARGS, ctypes.c_int)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """A slot's row `[Hkv, D]` is one contiguous run (the kernel reads it whole)."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def available() -> bool:
    """Whether the native kernel is built (compiling it on first call)."""
    return _kernel() is not None


def num_splits(num_seqs: int, max_len: int) -> int:
    """Splits per view (a work item is a sequence's split, every KV head): TARGET_ITEMS
    items, each split at least MIN_SPLIT_KEYS keys."""
    want = math.ceil(TARGET_ITEMS / max(num_seqs, 1))
    return max(1, min(want, max_len // MIN_SPLIT_KEYS))


def decode_attention(
    q: torch.Tensor,  # [S, Hq, D]
    k: torch.Tensor,  # [num_slots, Hkv, D]
    v: torch.Tensor,  # [num_slots, Hkv, Dv]
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32: each sequence's table row
    lens: torch.Tensor,  # [S] int32: view lengths, the query's own token included
    max_len: int,  # the longest view
    scale: float,
    window: int | None = None,
) -> torch.Tensor | None:  # [S, Hq, Dv] in q's dtype
    """Every sequence's query over its whole view (the last `window` entries with a
    sliding window), or None where the kernel does not apply."""
    fn = _kernel()
    tensors = (q, k, v, table, rows, lens)
    if fn is None or any(t.device.type != "cpu" for t in tensors):
        return None
    if k.dtype not in ELEMENT_TYPES or v.dtype != k.dtype or q.dtype not in ELEMENT_TYPES:
        return None
    if not (_rows_contiguous(k) and _rows_contiguous(v) and table.stride(-1) == 1):
        return None
    if table.dtype != torch.int32 or rows.dtype != torch.int32 or lens.dtype != torch.int32:
        return None
    if q.stride(2) != 1:
        return None
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, value_dim = k.shape[1], v.shape[2]
    threads = torch.get_num_threads()
    splits = num_splits(num_seqs, max_len)
    out = torch.empty(num_seqs, num_q_heads, value_dim, dtype=q.dtype)
    rows, lens = rows.contiguous(), lens.contiguous()
    failed = fn(
        q.data_ptr(), ELEMENT_TYPES[q.dtype], q.stride(0), q.stride(1),
        scale * LOG2E,  # the softmax in exp2
        k.data_ptr(), v.data_ptr(), ELEMENT_TYPES[k.dtype], k.stride(0), v.stride(0),
        table.data_ptr(), table.stride(0), rows.data_ptr(), lens.data_ptr(), out.data_ptr(),
        num_seqs, num_q_heads, num_kv_heads, head_dim, value_dim, window or 0, splits,
        max_len, threads,
    )  # fmt: skip
    if failed:
        raise MemoryError("the CPU decode attention kernel could not allocate its buffers")
    return out
