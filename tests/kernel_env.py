"""Where the kernel tests run: on CUDA when present, else on CPU under the Triton
interpreter (TRITON_INTERPRET=1, set by `make test` for tests/kernels)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def require_triton() -> None:
    """Skip the calling test module without Triton, or on CPU without the interpreter."""
    pytest.importorskip("triton")
    if not (torch.cuda.is_available() or INTERPRET):
        pytest.skip(
            "needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter",
            allow_module_level=True,
        )
