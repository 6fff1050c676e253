"""Reading a capture directory (`shards.py` writes it): its manifest and its sequences."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from sparsevllm.deltakv_tools.shards import (
    FORMAT,
    MANIFEST,
    VERSION,
    CaptureLayout,
    SequenceRef,
)


@dataclass
class SequenceData:
    """One stored sequence in memory: per layer keys, values `[T, Hkv, D]` (pre-RoPE)
    and queries `[Q, Hq, D]` (post-RoPE) in the storage dtype, the queries' positions
    `[Q]`, the layer's RoPE frequencies `[D/2]` (None: no RoPE) and the token ids `[T]`."""

    ref: SequenceRef
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    query_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    rope: dict[int, torch.Tensor | None] = field(default_factory=dict)
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))


@dataclass(frozen=True)
class CaptureSet:
    """A capture directory: its layout and the sequences it lists."""

    root: Path
    layout: CaptureLayout
    sequences: tuple[SequenceRef, ...]
    manifest: dict[str, object]

    def load(self, refs: tuple[SequenceRef, ...] | None = None) -> list[SequenceData]:
        """The given sequences (default: all), in order, read shard by shard."""
        wanted = self.sequences if refs is None else refs
        by_shard: dict[str, list[SequenceRef]] = {}
        for ref in wanted:
            by_shard.setdefault(ref.shard, []).append(ref)
        loaded: dict[int, SequenceData] = {}
        for shard, shard_refs in by_shard.items():
            with safe_open(str(self.root / shard), framework="pt") as f:
                names = set(f.keys())
                rope = {
                    layer: f.get_tensor(f"rope{layer}") if f"rope{layer}" in names else None
                    for layer in self.layout.layers
                }
                for ref in shard_refs:
                    data = SequenceData(
                        ref,
                        query_positions=f.get_tensor(f"s{ref.index}.qpos"),
                        tokens=f.get_tensor(f"s{ref.index}.tokens"),
                    )
                    for layer in self.layout.layers:
                        data.keys[layer] = f.get_tensor(f"s{ref.index}.k{layer}")
                        data.values[layer] = f.get_tensor(f"s{ref.index}.v{layer}")
                        data.queries[layer] = f.get_tensor(f"s{ref.index}.q{layer}")
                    data.rope = rope
                    loaded[ref.index] = data
        return [loaded[ref.index] for ref in wanted]


def open_capture(path: str | Path) -> CaptureSet:
    """The capture directory at `path` (what `sparsevllm deltakv collect --out` wrote)."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"no capture at {root} (no {MANIFEST}); make one with `sparsevllm deltakv collect`"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{manifest_path} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} is not a DeltaKV capture manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{manifest_path} has version {manifest.get('version')}, not {VERSION}")
    layout = CaptureLayout.from_json(json.dumps(manifest["layout"]))
    refs = tuple(SequenceRef(**r) for r in manifest["sequences"])
    missing = sorted({r.shard for r in refs if not (root / r.shard).is_file()})
    if missing:
        raise FileNotFoundError(f"{root}: shards listed in {MANIFEST} are missing: {missing}")
    if not refs:
        raise ValueError(f"{root}: the capture holds no sequence")
    return CaptureSet(root, layout, refs, manifest)
