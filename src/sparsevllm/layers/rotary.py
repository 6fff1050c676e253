"""Rotary position embeddings (RoPE), including Llama-3 and YaRN frequency scaling.

On CUDA one Triton kernel, on the CPU one native call (layers/cpu_rope.py) where a C
compiler built it; `_rotate` below defines the rounding points both keep."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sparsevllm.layers.cpu_rope import rope as cpu_rope


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config, for transformers 4.x and 5.x layouts."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair rotation frequencies, `[head_dim // 2]`, float32."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(params["factor"])).float()
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params).float()
    if rope_type == "yarn":
        return _yarn_scale(inv_freq, head_dim, params).float()
    raise ValueError(
        f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)"
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(params: dict[str, Any]) -> float:
    """The factor YaRN applies to cos and sin (1 for the other rope types), as
    transformers infers it: from `mscale` / `mscale_all_dim` when both are given."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _yarn_scale(inv_freq: torch.Tensor, dim: int, p: dict[str, Any]) -> torch.Tensor:
    # YaRN: frequencies that turn fewer than beta_slow times over the original context
    # are interpolated (divided by `factor`), those above beta_fast kept, a linear ramp
    # between (transformers' `_compute_yarn_parameters`).
    base, factor = float(p["rope_theta"]), float(p["factor"])
    old_len = float(p["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor, low, high = (
        float(p["factor"]),
        float(p["low_freq_factor"]),
        float(p["high_freq_factor"]),
    )
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE (rotate-half layout, as HF) to q and k at given positions."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self._max_position, self._params = max_position, params
        self.rebuild_buffers()
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rebuild_buffers(self) -> None:
        """Compute the angle tables (on the default device): at construction, and again
        after a model built on the meta device is allocated (`models/loader.py`)."""
        inv_freq = inverse_frequencies(self.head_dim, self._params)
        # The angle per position of each rotated pair `[head_dim // 2]` (float32): what a
        # sparse method needs to move queries between positions (rope_frequencies).
        self.inv_freq = inv_freq
        t = torch.arange(self._max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        scale = attention_factor(self._params)  # YaRN scales cos and sin alike
        # Kept in float32: bf16 angles at long positions lose too much precision.
        self.register_buffer("cos_cache", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * scale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        if q.is_cuda:  # one fused Triton kernel, the same float32 math
            from sparsevllm.attention.triton.rope import apply_rope

            return apply_rope(positions, q, k, self.cos_cache, self.sin_cache)
        native = cpu_rope(positions, q, k, self.cos_cache, self.sin_cache)
        if native is not None:
            return native
        cos, sin = self._angles(positions)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[cos, cos]` and `[-sin, sin]` at `positions`, `[T, 1, D]` each (the rotate-half
        layout's factors). Every layer of a forward passes the same positions tensor: they
        are looked up once (kept with that tensor, which the reference keeps alive, so a
        later step's positions are never mistaken for it)."""
        if self._last is None or self._last[0] is not positions:
            cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D/2]
            sin = self.sin_cache[positions].unsqueeze(1)
            self._last = (positions, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        return self._last[1], self._last[2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE, `(x1 cos - x2 sin, x2 cos + x1 sin)`, as `x * [cos, cos] +
    roll(x) * [-sin, sin]` with `roll(x) = (x2, x1)`: the same products and sums, so the
    same bits, in five operators instead of nine."""
    xf = x.float()  # [T, H, D]
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)
