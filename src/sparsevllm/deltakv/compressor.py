"""The DeltaKV compressor: per-layer down and up maps around a residual.

For a compressed token with vector x (`join_kv`: pre-RoPE K of every KV head, then V)
and references c_1..c_R (`centers.select_references`), with b = mean_i c_i:

    latent = down(x) - down(b)              compress     `[N, r]`
    x_hat  = up(latent) + b                 reconstruct  `[N, kv_dim]`

so the full-precision references carry the part of x they share with it and the latent
only the rest. Both maps are per layer: `nn.Linear` (hidden_dim 0) or a GELU MLP with
one hidden layer. Parameter names (what a checkpoint holds):
`layers.<model layer>.down_proj.weight` / `.bias` and `...up_proj...` for linear maps,
`...down_proj.fc_in.weight`, `...down_proj.fc_out.weight` (and biases) for MLPs.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from sparsevllm.deltakv.spec import DeltaKVSpec


def join_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values `[N, Hkv, D]` each -> token vectors `[N, 2 * Hkv * D]`."""
    return torch.cat([k.flatten(-2), v.flatten(-2)], dim=-1)


def split_kv(
    x: torch.Tensor, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token vectors `[..., 2 * Hkv * D]` -> (keys, values) `[..., Hkv, D]` each."""
    k, v = x.split(num_kv_heads * head_dim, dim=-1)
    shape = (*x.shape[:-1], num_kv_heads, head_dim)
    return k.reshape(shape), v.reshape(shape)


def reference_mean(centers: torch.Tensor) -> torch.Tensor:
    """A token's residual base: the mean of its references `[N, R, C]` -> `[N, C]`."""
    return centers.mean(dim=-2)


def make_map(in_dim: int, out_dim: int, hidden_dim: int) -> nn.Module:
    """A linear map, or `fc_in` -> GELU -> `fc_out` with `hidden_dim` hidden units."""
    if hidden_dim == 0:
        return nn.Linear(in_dim, out_dim)
    layers = OrderedDict(
        fc_in=nn.Linear(in_dim, hidden_dim), act=nn.GELU(), fc_out=nn.Linear(hidden_dim, out_dim)
    )
    return nn.Sequential(layers)


class LayerCodec(nn.Module):
    """One layer's maps: `down_proj` kv_dim -> r and `up_proj` r -> kv_dim."""

    def __init__(self, kv_dim: int, latent_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.down_proj = make_map(kv_dim, latent_dim, hidden_dim)
        self.up_proj = make_map(latent_dim, kv_dim, hidden_dim)


class DeltaKVCompressor(nn.Module):
    """Per-layer codecs of one model's managed layers (see the module docstring)."""

    def __init__(self, spec: DeltaKVSpec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict(
            {
                str(layer): LayerCodec(spec.kv_dim, spec.latent_dim(layer), spec.hidden_dim)
                for layer in spec.layers
            }
        )

    def codec(self, layer: int) -> LayerCodec:
        if layer not in self.spec.layers:
            raise KeyError(f"the compressor has no layer {layer} (its layers: {self.spec.layers})")
        codec = self.layers[str(layer)]
        assert isinstance(codec, LayerCodec)
        return codec

    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def compress(self, layer: int, kv: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """kv `[N, C]` tokens and centers `[N, R, C]` their references -> latents `[N, r]`
        (in the maps' dtype)."""
        down = self.codec(layer).down_proj
        dtype = self._param_dtype()
        base = reference_mean(centers.to(dtype))  # [N, C]
        latent: torch.Tensor = down(kv.to(dtype)) - down(base)  # [N, r]
        return latent

    def reconstruct(self, layer: int, latent: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """latents `[N, r]` and the same references `[N, R, C]` -> token vectors `[N, C]`."""
        up = self.codec(layer).up_proj
        dtype = self._param_dtype()
        base = reference_mean(centers.to(dtype))  # [N, C]
        out: torch.Tensor = up(latent.to(dtype)) + base  # [N, C]
        return out

    def forward(self, layer: int, kv: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """Compress then reconstruct (what training differentiates): `[N, C]`."""
        return self.reconstruct(layer, self.compress(layer, kv, centers), centers)
