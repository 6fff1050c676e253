"""Collected K/V/queries on disk: safetensors shards under a size cap, and a manifest.

A capture directory holds `manifest.json` and `shard-00000.safetensors`, ... Each shard
is self-contained: per sequence i (a global index) the tensors `s<i>.k<layer>` and
`s<i>.v<layer>` (pre-RoPE keys and values `[T, Hkv, D]`), `s<i>.q<layer>` (post-RoPE
queries `[Q, Hq, D]`) and `s<i>.qpos` (their positions `[Q]` int64), plus `rope<layer>`
(`[D/2]` float32, the layer's RoPE frequencies) and `s<i>.tokens` (the sequence's token
ids `[T]` int32, to run it again); its metadata holds the layout and the
sequences' keys, sources and lengths. The cap counts tensor bytes plus an allowance for
every header, so the files together never exceed it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparsevllm.calibration.schema import ModelIdentity
from sparsevllm.deltakv_tools.capture import CapturedSequence

FORMAT = "sparsevllm-deltakv-capture"
VERSION = 1
MANIFEST = "manifest.json"
STORE_DTYPES = ("float16", "bfloat16", "float32")
_TENSOR_HEADER = 256  # bytes allowed per tensor for its header entry
_SHARD_HEADER = 1 << 16  # bytes allowed per shard for the metadata and the header frame


@dataclass(frozen=True)
class CaptureLayout:
    """What every sequence of a capture shares: the model and its managed layers' shapes,
    each layer's attention scale, and the storage dtype of K, V and queries."""

    model_names: tuple[str, ...]
    model_fingerprint: str | None
    layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scales: dict[int, float]
    dtype: str = "float16"

    @property
    def model(self) -> ModelIdentity:
        return ModelIdentity(self.model_names, self.model_fingerprint)

    def to_json(self) -> str:
        data = asdict(self)
        data["scales"] = {str(k): v for k, v in self.scales.items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CaptureLayout:
        d = json.loads(text)
        return cls(
            model_names=tuple(d["model_names"]),
            model_fingerprint=d["model_fingerprint"],
            layers=tuple(int(x) for x in d["layers"]),
            num_heads=int(d["num_heads"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            scales={int(k): float(v) for k, v in d["scales"].items()},
            dtype=str(d["dtype"]),
        )


@dataclass(frozen=True)
class SequenceRef:
    """One stored sequence: where it is and what it came from."""

    index: int
    key: str
    source: str
    length: int
    queries: int
    shard: str


def _tensors_of(
    index: int, rec: CapturedSequence, ids: list[int], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {
        f"s{index}.qpos": rec.query_positions.to(torch.int64),
        f"s{index}.tokens": torch.tensor(ids, dtype=torch.int32),
    }
    for layer in rec.keys:
        out[f"s{index}.k{layer}"] = rec.keys[layer].to(dtype).contiguous()
        out[f"s{index}.v{layer}"] = rec.values[layer].to(dtype).contiguous()
        out[f"s{index}.q{layer}"] = rec.queries[layer].to(dtype).contiguous()
    return out


def estimate_bytes(layout: CaptureLayout, length: int, queries: int) -> int:
    """What one sequence of `length` tokens will add to a shard (its allowance included)."""
    item = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    q = min(queries, length)
    per_layer = (2 * length * layout.num_kv_heads + q * layout.num_heads) * layout.head_dim
    data = len(layout.layers) * per_layer * item + 8 * q + 4 * length
    return data + _TENSOR_HEADER * (3 * len(layout.layers) + 2)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return data + _TENSOR_HEADER * len(tensors)


class ShardWriter:
    """Appends captured sequences to shards of about `shard_bytes`, never letting the
    directory's files exceed `max_bytes` in all."""

    def __init__(self, out: Path, layout: CaptureLayout, max_bytes: int, shard_bytes: int) -> None:
        if layout.dtype not in STORE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORE_DTYPES)}")
        self.out, self.layout = out, layout
        self.max_bytes, self.shard_bytes = max_bytes, shard_bytes
        self._dtype: torch.dtype = getattr(torch, layout.dtype)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_refs: list[SequenceRef] = []
        self._shards: list[dict[str, object]] = []
        self._written = 0  # bytes of the shards already on disk
        self._rope: dict[int, torch.Tensor | None] = {}
        self.refs: list[SequenceRef] = []  # the sequences in written shards
        self._count = 0  # sequences accepted (written or pending)
        out.mkdir(parents=True, exist_ok=True)

    @property
    def bytes_used(self) -> int:
        """Bytes on disk plus what the open shard will take (its allowance included)."""
        if not self._pending:
            return self._written
        return self._written + _nbytes(self._pending) + self._rope_bytes() + _SHARD_HEADER

    def _rope_bytes(self) -> int:
        return sum(4 * f.numel() + _TENSOR_HEADER for f in self._rope.values() if f is not None)

    def add(self, key: str, source: str, rec: CapturedSequence, ids: list[int]) -> bool:
        """Store one sequence (its capture and token ids); False (nothing stored) when it
        would pass the cap."""
        if len(ids) != rec.length:
            raise ValueError(f"{key}: {len(ids)} token ids for a {rec.length}-token capture")
        index = self._count
        tensors = _tensors_of(index, rec, ids, self._dtype)
        self._rope = rec.rope
        extra = _nbytes(tensors) + (0 if self._pending else self._rope_bytes() + _SHARD_HEADER)
        if self.bytes_used + extra > self.max_bytes:
            return False
        ref = SequenceRef(index, key, source, rec.length, int(rec.query_positions.numel()), "")
        self._pending.update(tensors)
        self._pending_refs.append(ref)
        self._count += 1
        if _nbytes(self._pending) >= self.shard_bytes:
            self._flush()
        return True

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}.safetensors"
        refs = [SequenceRef(**{**asdict(r), "shard": name}) for r in self._pending_refs]
        tensors = dict(self._pending)
        for layer, freqs in self._rope.items():
            if freqs is not None:
                tensors[f"rope{layer}"] = freqs.float().clone()
        meta = {
            "format": FORMAT,
            "version": str(VERSION),
            "layout": self.layout.to_json(),
            "sequences": json.dumps([asdict(r) for r in refs]),
        }
        save_file(tensors, str(self.out / name), metadata=meta)
        size = (self.out / name).stat().st_size
        self._written += size
        self._shards.append({"file": name, "bytes": size, "sequences": len(refs)})
        self.refs.extend(refs)
        self._pending, self._pending_refs = {}, []

    def finish(self, extra: dict[str, object]) -> dict[str, object]:
        """Write the open shard and `manifest.json`; returns the manifest."""
        self._flush()
        manifest: dict[str, object] = {
            "format": FORMAT,
            "version": VERSION,
            "layout": json.loads(self.layout.to_json()),
            "shards": self._shards,
            "num_sequences": len(self.refs),
            "num_tokens": sum(r.length for r in self.refs),
            "bytes": self._written,
            "max_bytes": self.max_bytes,
            "sequences": [asdict(r) for r in self.refs],
            **extra,
        }
        (self.out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest
