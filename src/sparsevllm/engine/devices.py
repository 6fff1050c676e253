"""Where the engine runs: the device and dtype a config names."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, and on a CPU that computes it natively; float32 else."""
    if name == "auto":
        native = device.type == "cuda" or cpu_computes_bfloat16()
        return torch.bfloat16 if native else torch.float32
    return _DTYPES[name]


def cpu_computes_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX): without it bfloat16
    is emulated through float32 and is slower than float32 itself."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
