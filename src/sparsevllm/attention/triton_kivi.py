"""KIVI storage (kv/kivi.py) inside the Triton backend.

A decode step over whole views, the common step of a long generation and the one whose
cost grows with the context, runs the KIVI decode kernel (attention/triton/
decode_kivi.py), which reads the packed codes and the residual rows where they lie. The
other steps (prefill chunks, a method's selected views, the probabilities a method asks
for) go through the torch reference over dequantized reads, on the same device. Storing
is the storage's own (a residual row per new token, from a free stack on the device):
a decode step over whole views has no host sync and is captured in a CUDA graph; steps
that go through the reference are not (TritonBackend.graph_views_safe).
"""

from __future__ import annotations

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.torch_ref import TorchRefBackend
from sparsevllm.attention.triton._common import next_pow2
from sparsevllm.attention.triton.decode_kivi import kivi_decode_attention
from sparsevllm.kv.format import KVStorage
from sparsevllm.kv.kivi import KiviStorage


def kernel_reads(storage: KiviStorage) -> bool:
    """Whether the decode kernel reads this storage: a power-of-two head_dim whose
    planes (head_dim * bits / 8 channels) fill a tensor-core operand."""
    d = storage.head_dim
    return d == next_pow2(d) and d * storage.bits // 8 >= 16


class KiviAttention:
    """The KIVI layers' attention: the decode kernel, else the reference."""

    def __init__(self, storage: list[KVStorage]) -> None:
        self.reference = TorchRefBackend(storage)
        self.storage = storage

    def decode_captures(self, windowed: frozenset[int]) -> bool:
        """Whether every KIVI layer's whole-view decode step runs the kernel (whose
        launch and store capture in a CUDA graph): not a sliding-window layer, and a
        head_dim the kernel reads."""
        return all(
            layer not in windowed and kernel_reads(storage)
            for layer, storage in enumerate(self.storage)
            if isinstance(storage, KiviStorage)
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        batch: ForwardBatch,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:  # [T, Hq, D]
        storage = self.storage[layer]
        assert isinstance(storage, KiviStorage)
        self.reference.store_step(layer, q, k, v, batch, scale, window)
        if not self._kernel_serves(layer, storage, batch, window):
            return self.reference.attend_stored(layer, q, k, v, batch, scale, window)
        group = batch.group_of_layer[layer]
        out = torch.empty_like(q)
        kivi_decode_attention(
            q,
            storage.k,
            storage.v,
            storage.v_params,
            storage.state,
            storage.key_groups,
            storage.res_k,
            storage.res_v,
            batch.tables[group],
            batch.rows_t,
            batch.view_lens_t[group],
            scale,
            out,
            bits=storage.bits,
            # Tiles of one key group each take the kernel's fast loop.
            block_n=max(16, next_pow2(storage.kivi.group_size)),
        )
        return out

    @staticmethod
    def _kernel_serves(
        layer: int, storage: KiviStorage, batch: ForwardBatch, window: int | None
    ) -> bool:
        """A decode step over whole views: no window, no selection, no scores asked."""
        if window is not None or not batch.decode_only or not kernel_reads(storage):
            return False
        if batch.sparse.select_views is not None:
            return False
        return not batch.asks_scores(layer)
