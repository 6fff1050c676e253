"""Optional INT4 packing of DeltaKV latents: KIVI's asymmetric codes, per token.

A latent `[r]` is cut into groups of `group_size` consecutive channels (0: one group,
the whole latent, as the reference runtime does by default); each group keeps a float16
scale and zero point (its minimum) and 4-bit codes, two to a byte in KIVI's planar
layout (`kv/kivi_codes.py`). A token's latent then costs r / 2 bytes + 4 bytes a group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsevllm.kv import kivi_codes

BITS = 4


@dataclass(frozen=True)
class PackedLatents:
    """codes `[N, r / 2]` uint8 (one plane pair per group) and params `[N, G, 2]` float16."""

    codes: torch.Tensor
    params: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.params.numel() * 2


def _groups(width: int, group_size: int) -> int:
    size = group_size or width
    if width % size or size % 2:
        raise ValueError(
            f"latent width {width} must be a multiple of an even group size, got {size}"
        )
    return width // size


def pack_latents(latent: torch.Tensor, group_size: int = 0) -> PackedLatents:
    """latent `[N, r]` (any float dtype) -> its INT4 codes and group parameters."""
    n, width = latent.shape
    groups = _groups(width, group_size)
    x = latent.float().reshape(n, groups, width // groups)  # [N, G, g]
    par = kivi_codes.token_params(x, BITS)  # [N, G, 2]
    codes = kivi_codes.quantize(x, par.unsqueeze(-2), BITS)  # [N, G, g] uint8
    packed = kivi_codes.pack(codes, BITS)  # [N, G, g / 2]
    return PackedLatents(packed.reshape(n, width // 2), par)


def unpack_latents(packed: PackedLatents) -> torch.Tensor:
    """PackedLatents -> latents `[N, r]` float32 (the dequantized values)."""
    n, groups = packed.params.shape[:2]
    codes = kivi_codes.unpack(packed.codes.reshape(n, groups, -1), BITS)  # [N, G, g]
    x = kivi_codes.dequantize(codes, packed.params.unsqueeze(-2))  # [N, G, g]
    return x.reshape(n, -1)


def quantize_latents(latent: torch.Tensor, group_size: int = 0) -> torch.Tensor:
    """What a latent reads back as after INT4 storage: `[N, r]` float32."""
    return unpack_latents(pack_latents(latent, group_size))
