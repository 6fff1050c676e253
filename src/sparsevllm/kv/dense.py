"""`kv_cache_dtype="auto"`: K and V in the model dtype, as computed; `bfloat16` and
`float16`: K and V rounded to a 16-bit float whatever the compute dtype.

The 16-bit formats are for float32 compute (the CPU default where bfloat16 is slow):
they halve float32's KV bytes, and are the precision floor that the 8-bit formats are
measured against (docs/quality/README.md). A CUDA engine computes in bfloat16, where
`auto` already stores bfloat16, so they are CPU formats (the Triton kernels read K and
V in the compute dtype)."""

from __future__ import annotations

import torch

from sparsevllm.kv.cpu_store import store as cpu_store
from sparsevllm.kv.format import KVFormat, KVStorage, kv_zeros, real_rows


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
        stored = fmt.element_dtype or dtype
        self.k = kv_zeros(shape, stored, device)
        self.v = kv_zeros(shape, stored, device)

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> DenseStorage:
        """A storage over existing `[num_slots, Hkv, D]` tensors (harnesses, benchmarks)."""
        storage = cls.__new__(cls)
        KVStorage.__init__(storage, MODEL_DTYPE, k.dtype)
        storage.k, storage.v = k, v
        return storage

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if cpu_store(k, v, slots, self.k, self.v):  # the CPU's rows in one native call
            return
        k, v, slots = real_rows(k, v, slots)
        # index_copy_ rather than indexed assignment: the same rows, half the time on the
        # CPU for a decode step's few (3 against 6.5 us for 16).
        slots = slots.long()
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return data.to(self.dtype)  # a no-op in the model dtype


MODEL_DTYPE = KVFormat(
    name="auto",
    help="K and V in the model dtype (no quantization)",
    element_dtype=None,
    scaled=False,
    factory=DenseStorage,
)


def _float16_format(name: str, dtype: torch.dtype) -> KVFormat:
    return KVFormat(
        name=name,
        help=f"K and V stored as {name} under any compute dtype (half of float32's bytes; "
        "CPU only: on CUDA, auto stores bfloat16)",
        element_dtype=dtype,
        scaled=False,
        factory=DenseStorage,
        devices=("cpu",),
    )


BFLOAT16 = _float16_format("bfloat16", torch.bfloat16)
FLOAT16 = _float16_format("float16", torch.float16)
