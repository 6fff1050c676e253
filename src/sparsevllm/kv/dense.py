"""`kv_cache_dtype="auto"`: K and V in the model dtype, as computed."""

from __future__ import annotations

import torch

from sparsevllm.kv.format import KVFormat, KVStorage, kv_zeros


class DenseStorage(KVStorage):
    def __init__(
        self,
        fmt: KVFormat,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(fmt, dtype)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = kv_zeros(shape, dtype, device)
        self.v = kv_zeros(shape, dtype, device)

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> DenseStorage:
        """A storage over existing `[num_slots, Hkv, D]` tensors (harnesses, benchmarks)."""
        storage = cls.__new__(cls)
        KVStorage.__init__(storage, MODEL_DTYPE, k.dtype)
        storage.k, storage.v = k, v
        return storage

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        keep = slots >= 0
        if not bool(keep.all()):
            k, v, slots = k[keep], v[keep], slots[keep]
        self.k[slots] = k.to(self.k.dtype)
        self.v[slots] = v.to(self.v.dtype)

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return data


MODEL_DTYPE = KVFormat(
    name="auto",
    help="K and V in the model dtype (no quantization)",
    element_dtype=None,
    scaled=False,
    factory=DenseStorage,
)
