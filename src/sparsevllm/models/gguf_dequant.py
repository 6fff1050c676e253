"""Dequantization of GGUF tensors to float32, whole tensors at a time.

`gguf.quants.dequantize` splits a tensor into groups of rows and dequantizes each
group separately, which costs more in Python overhead than in arithmetic for the
small-block formats. The formats of the default model (Q8_0, Q4_1) and their siblings
are done here in a few numpy passes over the whole tensor; every other format goes to
the `gguf` library. Results are bit-identical to the library's (tested).
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

_QTYPE = gguf.GGMLQuantizationType


def _scale(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 block scale stored at byte `start` of every block, as a float32 column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 packed bytes per block -> 32 values: the low nibbles first, then the high ones."""
    out = np.empty((packed.shape[0], 2 * packed.shape[1]), dtype=np.float32)
    half = packed.shape[1]
    np.bitwise_and(packed, 0x0F, out=out[:, :half], casting="unsafe")
    np.right_shift(packed, 4, out=out[:, half:], casting="unsafe")
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    values = blocks[:, 2:].view(np.int8).astype(np.float32)
    return np.multiply(values, _scale(blocks, 0), out=values)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    values = _nibbles(blocks[:, 2:])
    values -= 8.0
    return np.multiply(values, _scale(blocks, 0), out=values)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    values = _nibbles(blocks[:, 4:])
    values *= _scale(blocks, 0)
    values += _scale(blocks, 2)
    return values


_FAST: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    _QTYPE.Q8_0: _q8_0,
    _QTYPE.Q4_0: _q4_0,
    _QTYPE.Q4_1: _q4_1,
}


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of shape `shape` from a tensor's stored data (as `GGUFFile.tensor_data`
    returns it); owned memory, never a view of the file."""
    fast = _FAST.get(ggml_type)
    if fast is not None:
        block_bytes = gguf.GGML_QUANT_SIZES[_QTYPE(ggml_type)][1]
        return fast(np.asarray(data).reshape(-1, block_bytes)).reshape(shape)
    values = gguf.quants.dequantize(data, ggml_type).reshape(shape)
    # F32 data comes back as a read-only view of the file: copy it into owned memory.
    return np.array(values, dtype=np.float32, copy=True)
