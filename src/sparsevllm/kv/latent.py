"""Storage of a `shared_kv` layout (MLA's latent rows) in any `kv_cache_dtype`.

One buffer `kv` `[num_slots, 1, kv_lora_rank + rope_dim]` in the format's element type
(and, for the scaled formats, one float32 `kv_scale` `[num_slots, 1]` per row). `k` is
that buffer and `v` a view of its first `value_dim` columns with the same scale, so
every reader of keys and values (the reference attention, methods' scores, Quest's page
bounds, pruning) works unchanged, while `buffers()` names the one buffer: compaction,
the radix cache and the tiers move each token's row once, and `bytes_per_slot` counts it
once.
"""

from __future__ import annotations

import torch

from sparsevllm.kv.format import KVFormat, KVStorage, kv_zeros, real_rows
from sparsevllm.kv.layout import SlotLayout
from sparsevllm.kv.scaled import dequantize, quantize


class LatentStorage(KVStorage):
    def __init__(
        self,
        fmt: KVFormat,
        num_slots: int,
        layout: SlotLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(fmt, dtype)
        if not layout.shared_kv:
            raise ValueError(f"LatentStorage stores shared-KV layouts, not {layout.name}")
        shape = (num_slots, layout.num_kv_heads, layout.head_dim)
        self.k = kv_zeros(shape, fmt.element_dtype or dtype, device)
        self.v = self.k[..., : layout.value_dim]  # a view: the value is the row's prefix
        if fmt.scaled:
            self.k_scale = kv_zeros(shape[:2], torch.float32, device)
            self.v_scale = self.k_scale  # one scale per row serves its prefix too

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {"kv": self.k}
        if self.k_scale is not None:
            out["kv_scale"] = self.k_scale
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows `k` `[T, 1, W]`; `v` is their prefix and is not read."""
        k, _, slots = real_rows(k, k, slots)
        if self.k_scale is None:
            self.k[slots] = k.to(self.k.dtype)
        else:
            self.k[slots], self.k_scale[slots] = quantize(k, self.k.dtype)

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        return data.to(self.dtype) if scale is None else dequantize(data, scale, self.dtype)
