"""`fp8_e4m3` and `int8`: one element per channel, one float32 scale per token and KV
head for K and for V (symmetric absmax scaling, computed when the token is stored).

A per-token scale keeps every slot self-contained: eviction, per-head compaction,
prefix sharing and the tiers move a token with its own scale, and nothing is ever
re-quantized. The scale costs 4 bytes per 128-channel head (3% of an INT8 row).
"""

from __future__ import annotations

import torch

from sparsevllm.kv.format import KVFormat, KVStorage, kv_zeros, real_rows

# The largest magnitude each element type represents (the absmax maps onto it).
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize(x: torch.Tensor, element: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantization of `x` `[..., D]`: elements `[..., D]` and scales `[...]`.

    scale = absmax / QMAX (1 where a row is all zero); element = x / scale, rounded to
    the nearest representable value (half to even for int8), computed in float32.
    """
    xf = x.float()
    qmax = QMAX[element]
    amax = xf.abs().amax(dim=-1)  # [...]
    # A tensor divisor: CUDA torch turns division by a Python number into a multiplication
    # by its reciprocal, which is not IEEE division (the kernels' and the CPU's).
    scale = amax / torch.full_like(amax, qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / scale.unsqueeze(-1)
    if element == torch.int8:
        y = torch.round(y).clamp(-qmax, qmax)
    return y.to(element), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of `data` `[..., D]` with `scale` `[...]`, in `dtype` (float32 product)."""
    return (data.float() * scale.unsqueeze(-1)).to(dtype)


class ScaledStorage(KVStorage):
    k_scale: torch.Tensor
    v_scale: torch.Tensor

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
        assert fmt.element_dtype is not None
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = kv_zeros(shape, fmt.element_dtype, device)
        self.v = kv_zeros(shape, fmt.element_dtype, device)
        self.k_scale = kv_zeros(shape[:2], torch.float32, device)
        self.v_scale = kv_zeros(shape[:2], torch.float32, device)

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        k, v, slots = real_rows(k, v, slots)
        element = self.k.dtype
        self.k[slots], self.k_scale[slots] = quantize(k, element)
        self.v[slots], self.v_scale[slots] = quantize(v, element)

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        assert scale is not None
        return dequantize(data, scale, self.dtype)


FP8_E4M3 = KVFormat(
    name="fp8_e4m3",
    help="float8 e4m3 elements with a float32 scale per token and KV head (about half of "
    "bf16's bytes)",
    element_dtype=torch.float8_e4m3fn,
    scaled=True,
    factory=ScaledStorage,
    # Triton converts float8e4nv from Ada/Hopper (sm 8.9) on.
    min_cuda_capability=(8, 9),
)
INT8 = KVFormat(
    name="int8",
    help="int8 elements with a float32 scale per token and KV head (about half of bf16's bytes)",
    element_dtype=torch.int8,
    scaled=True,
    factory=ScaledStorage,
)
