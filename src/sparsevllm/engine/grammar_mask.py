"""The token bitmask of a step's rows with structured outputs: filled on the host from
their grammars as they stand now (engine/structured.py), then uploaded for the sampler
to apply (layers/sampler.py). Works on any device: the fill is host work, the copy is
asynchronous from pinned memory on CUDA."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsevllm.engine.structured import GrammarState, fill_bitmasks
from sparsevllm.layers.sampler import TokenBitmask
from sparsevllm.upload import upload


def grammar_bitmask(
    states: Sequence[GrammarState | None], device: torch.device
) -> TokenBitmask | None:
    """The mask of the sampling rows whose grammar is still running (None if none is).

    A finished grammar's row is left unmasked: its request ended with the step before
    (a step scheduled ahead still samples for it, and that token is dropped)."""
    live = [(i, s) for i, s in enumerate(states) if s is not None and not s.is_finished]
    if not live:
        return None
    words = live[0][1].mask_words
    host = torch.empty((len(live), words), dtype=torch.int32, pin_memory=device.type == "cuda")
    fill_bitmasks([s for _, s in live], host.data_ptr(), words * host.element_size())
    bits = host.to(device, non_blocking=True)
    return TokenBitmask(upload([i for i, _ in live], torch.long, device), bits)
