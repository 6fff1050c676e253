"""Host values -> device tensors without blocking the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for every
kernel already queued on the stream: with overlapped scheduling that would stall the
launch of the next step until the current one finishes. Staging through pinned memory
makes the copy asynchronous (stream-ordered), so it is safe to reuse the result at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a 1-D `dtype` tensor on `device` (asynchronous on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
