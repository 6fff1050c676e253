"""The CPU attention backend: the torch reference backend, with decode steps over whole
views served by a native kernel that reads K and V in place through the slot table
(attention/cpu/decode.py) instead of copying every view out of the pool for SDPA.

bfloat16 prefill chunks with plain causal masks go through a native kernel too
(attention/cpu/prefill.py). Everything else (windows, methods' selected views and scores,
quantized and latent formats) is the reference's. Where the kernel cannot run (no C compiler on the machine),
the backend is the reference backend.
"""

from __future__ import annotations

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.cpu.decode import decode_attention
from sparsevllm.attention.cpu.prefill import prefill_attention
from sparsevllm.attention.torch_ref import TorchRefBackend, whole_view_decode
from sparsevllm.kv.dense import DenseStorage


class CPUBackend(TorchRefBackend):
    name = "cpu"

    def decode_whole_views(
        self,
        layer: int,
        q: torch.Tensor,  # [S, Hq, D]
        batch: ForwardBatch,
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:  # [S, Hq, Dv]
        storage = self.storage[layer]
        # Plain float K/V (the model dtype, or bfloat16 / float16 under float32 compute):
        # quantized and latent formats decode what they read, through the reference.
        if type(storage) is DenseStorage and whole_view_decode(layer, batch, window):
            group = batch.group_of_layer[layer]
            out = decode_attention(
                q,
                storage.k,
                storage.v,
                batch.tables[group],
                batch.rows_t,
                batch.view_lens_t[group],
                batch.max_view_len(group),
                scale,
                window,
            )
            if out is not None:
                return out
        return super().decode_whole_views(layer, q, batch, scale, window)

    def attend_chunk(
        self,
        q: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,  # [L, Hkv, Dv]
        scale: float,
        window: int | None,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:  # [n, Hq, Dv]
        # Plain causal chunks in bfloat16 through the native kernel; windows, masks and
        # other dtypes through SDPA.
        if window is None and key_mask is None:
            out = prefill_attention(q, k, v, scale)
            if out is not None:
                return out
        return super().attend_chunk(q, k, v, scale, window, key_mask)
