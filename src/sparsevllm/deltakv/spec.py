"""What one DeltaKV compressor is: the reference rule it was trained against and its dims.

The reference rule (sink, center stride, references per token) is part of a compressor,
not a serving knob: the maps learn the residuals of one rule, so a checkpoint records
it and serving reads it from there. Torch-free (the checkpoint metadata is plain JSON).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DeltaKVSpec:
    """A compressor's shape and reference rule (docs/methods.md, "DeltaKV").

    - `layers`: the model layers it compresses, ascending (the layers a sparse method
      manages: sliding-window layers keep their window and are never compressed).
    - `num_kv_heads`, `head_dim`: one token's vector at a layer is its pre-RoPE key of
      every KV head followed by its value of every KV head, `kv_dim = 2 * Hkv * D`.
    - `latent_dims`: the latent width of each layer in `layers` (same order).
    - `hidden_dim`: 0 for linear down/up maps, else the width of one GELU hidden layer.
    - `sink_tokens`: the first positions, always full precision (and centers).
    - `center_stride`: every `center_stride`-th position from `sink_tokens` on is a
      center (full precision); `1 / center_stride` is the paper's cluster ratio.
    - `num_references`: a compressed token's residual is taken against the mean of its
      `num_references` nearest (L2) preceding centers.
    """

    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    latent_dims: tuple[int, ...]
    hidden_dim: int = 0
    sink_tokens: int = 4
    center_stride: int = 10
    num_references: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "latent_dims", tuple(int(x) for x in self.latent_dims))
        if not self.layers or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"layers must be distinct and ascending, got {list(self.layers)}")
        if len(self.latent_dims) != len(self.layers):
            raise ValueError(
                f"latent_dims has {len(self.latent_dims)} entries for {len(self.layers)} layers"
            )
        for name in ("num_kv_heads", "head_dim", "center_stride", "num_references"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_dim < 0 or self.sink_tokens < 0:
            raise ValueError("hidden_dim and sink_tokens must be >= 0")
        bad = [r for r in self.latent_dims if not 1 <= r <= self.kv_dim]
        if bad:
            raise ValueError(f"latent dims must lie in [1, kv_dim={self.kv_dim}], got {bad}")
        if self.num_references > self.sink_tokens + 1:
            raise ValueError(
                f"num_references ({self.num_references}) must be at most sink_tokens + 1 "
                f"({self.sink_tokens + 1}), so that every compressed token has that many "
                "preceding centers"
            )

    @property
    def kv_dim(self) -> int:
        """Width of one token's vector at a layer: K of every KV head, then V."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def cluster_ratio(self) -> float:
        return 1.0 / self.center_stride

    def latent_dim(self, layer: int) -> int:
        return self.latent_dims[self.layers.index(layer)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> DeltaKVSpec:
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown DeltaKV spec fields {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]  # checked by __post_init__

    @classmethod
    def from_json(cls, text: str) -> DeltaKVSpec:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a DeltaKV spec must be a JSON object")
        return cls.from_mapping(data)


def stride_of_ratio(cluster_ratio: float) -> int:
    """The center stride of a cluster ratio (0.1: every 10th token), refusing ratios whose
    inverse is not close to a whole number of tokens."""
    if not 0.0 < cluster_ratio <= 1.0:
        raise ValueError(f"cluster ratio must lie in (0, 1], got {cluster_ratio}")
    stride = round(1.0 / cluster_ratio)
    if abs(stride * cluster_ratio - 1.0) > 0.02:
        raise ValueError(
            f"cluster ratio {cluster_ratio} is not 1 / (a whole number of tokens); "
            f"the nearest is {1.0 / stride:g}"
        )
    return stride
