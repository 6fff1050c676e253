"""Captured sequences as training and evaluation inputs: the split, and per-layer views.

The split is by sequence, from a hash of its key: the same key lands in the same split
whatever else a capture holds, so `eval --split val` after `train` sees exactly the
held-out sequences. Each view caches the sequence's reference selection (the rule in
`deltakv.centers`, which depends on the data only, not on the maps being trained).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsevllm.deltakv.centers import compressed_positions, select_references
from sparsevllm.deltakv.compressor import join_kv
from sparsevllm.deltakv.spec import DeltaKVSpec
from sparsevllm.deltakv_tools.capture_set import SequenceData
from sparsevllm.deltakv_tools.shards import CaptureLayout, SequenceRef


def _unit(key: str) -> float:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return int(digest[:12], 16) / float(16**12)


def split_refs(
    refs: Sequence[SequenceRef], val_fraction: float
) -> tuple[tuple[SequenceRef, ...], tuple[SequenceRef, ...]]:
    """(train, validation): a sequence is held out when the hash of its key falls below
    `val_fraction`; with at least two sequences, each side gets at least one."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"the validation fraction must lie in [0, 1), got {val_fraction}")
    ranked = sorted(refs, key=lambda r: _unit(r.key))
    val = [r for r in ranked if _unit(r.key) < val_fraction]
    if val_fraction > 0 and not val and len(ranked) >= 2:
        val = ranked[:1]
    if len(val) == len(ranked) and len(ranked) >= 2:
        val = val[:-1]
    held = {r.index for r in val}
    train = tuple(r for r in refs if r.index not in held)
    return train, tuple(r for r in refs if r.index in held)


@dataclass
class LayerView:
    """One sequence at one layer: vectors x `[T, C]` float32 (pre-RoPE K, then V), the
    compressed positions `[N]` and their references `[N, R]`, the captured queries
    `[Q, Hq, D]` float32 at `query_positions` `[Q]`, RoPE frequencies `[D/2]` or None,
    the attention scale, and (filled by the losses) the exact attention output."""

    x: torch.Tensor
    compressed: torch.Tensor
    refs: torch.Tensor
    queries: torch.Tensor
    query_positions: torch.Tensor
    rope: torch.Tensor | None
    scale: float
    exact_output: torch.Tensor | None = None


class SequenceViews:
    """Per-layer views of loaded sequences on one device (references computed once)."""

    def __init__(
        self,
        sequences: Sequence[SequenceData],
        layout: CaptureLayout,
        spec: DeltaKVSpec,
        device: torch.device,
    ) -> None:
        self.sequences = list(sequences)
        self.layout, self.spec, self.device = layout, spec, device
        self._cache: dict[tuple[int, int], LayerView] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(s.ref.length for s in self.sequences)

    def view(self, i: int, layer: int) -> LayerView:
        key = (i, layer)
        if key not in self._cache:
            self._cache[key] = self._make(self.sequences[i], layer)
        return self._cache[key]

    def _make(self, seq: SequenceData, layer: int) -> LayerView:
        s = self.spec
        x = join_kv(seq.keys[layer].float(), seq.values[layer].float()).to(self.device)  # [T, C]
        refs = select_references(x, s.sink_tokens, s.center_stride, s.num_references)
        rope = seq.rope.get(layer)
        return LayerView(
            x=x,
            compressed=compressed_positions(x.shape[0], s.sink_tokens, s.center_stride).to(
                self.device
            ),
            refs=refs,
            queries=seq.queries[layer].float().to(self.device),
            query_positions=seq.query_positions.to(self.device),
            rope=None if rope is None else rope.to(self.device),
            scale=self.layout.scales[layer],
        )
