"""Where the engine runs: the device and dtype a config names, and KV allocation."""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV tensor. On the CPU its memory comes from numpy's calloc, whose
    pages the OS maps zeroed on first touch: torch.zeros would write the whole pool at
    start (a second per GiB here) although a request touches only the slots it uses."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Same-size integer storage, reinterpreted: all-zero bits are 0.0 in every float dtype.
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=bits)).view(dtype)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
