"""The disk tier: one file per entry (idle chain or radix node), LRU-capped by size,
kept across restarts.

Files live in `disk_offload_dir/<fingerprint digest>/`. The fingerprint names what
shapes the KV bytes (format version, model identity, dtype, layers, KV heads, head dim,
layer groups, sparse method and its knobs, and which store wrote them); an engine only
ever reads its own directory and checks every file's recorded fingerprint again on
start, so KV written by another model, configuration or format is never used. A file is
written to `*.tmp`, synced and renamed, so a crash leaves either the whole entry or a
`*.tmp` leftover (removed on start).

A file holds the entry's logical tokens, its K/V rows per layer (view order), the
per-entry device state the stack adds (a chain's view positions and method state) and
JSON metadata: the fingerprint, the entry's name, rows per pool group, when it was
written and the store's own fields.

The cap (`disk_offload_gb`) bounds the committed entries: to add one, the least
recently written entries are evicted (their stores forget them through `on_evict`).
Restoring an entry deletes its file (it is resident again). One engine per directory:
two engines sharing one would evict each other's files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from sparsevllm.engine.cache.kv_rows import HostRows, StatePayload
from sparsevllm.engine.cache.tiering import DiskRecord, SavedEntry

if TYPE_CHECKING:
    from sparsevllm.config import EngineConfig
    from sparsevllm.engine.runner import ModelRunner
    from sparsevllm.models.loader import ModelSource

logger = logging.getLogger(__name__)

# 2: one layout for both stores (rows, "state", the entry's "name" in the metadata).
FORMAT_VERSION = 2


def kv_fingerprint(
    config: EngineConfig, source: ModelSource, runner: ModelRunner, layer_groups: list[list[int]]
) -> dict[str, object]:
    """What must match for saved KV to be reused bit-for-bit by this engine."""
    method = runner.method
    return {
        "format": FORMAT_VERSION,
        "model": _model_identity(source.path),
        "load_format": source.load_format,
        # Dummy weights come from the seed.
        "weights_seed": config.seed if source.load_format == "dummy" else None,
        "dtype": str(runner.dtype),
        "num_layers": runner.num_layers,
        "num_kv_heads": runner.num_kv_heads,
        "head_dim": runner.head_dim,
        "layer_groups": layer_groups,
        "sparse_method": config.sparse_method,
        "knobs": method.knob_values(),
    }


def _model_identity(path: str) -> dict[str, object]:
    """The model path plus size and modification time of its weight and config files."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(p.iterdir()) if p.is_dir() else []
    stamps = {
        f.name: [f.stat().st_size, f.stat().st_mtime_ns]
        for f in files
        if f.is_file() and f.suffix in (".gguf", ".safetensors", ".bin", ".json")
    }
    return {"path": str(p), "files": stamps}


def _digest(fingerprint: dict[str, object]) -> str:
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Entry:
    path: Path
    nbytes: int
    counts: list[int]


class DiskTier:
    """Committed entries by key, least recently written first, within a byte cap."""

    def __init__(self, root: str, capacity_bytes: int, fingerprint: dict[str, object]) -> None:
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as read back from a file
        self.dir = Path(root) / _digest(fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._entries: dict[int, _Entry] = {}  # key -> entry, least recently written first
        self.on_evict: Callable[[int], None] | None = None
        self.num_written = 0
        self.num_read = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def has(self, key: int) -> bool:
        return key in self._entries

    def counts(self, key: int) -> list[int]:
        return self._entries[key].counts

    # -- start: what an earlier engine left -----------------------------------------------
    def scan(self) -> list[SavedEntry]:
        """Valid entries in this directory, oldest first; leftovers and bad files go."""
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        found = []
        for path in self.dir.glob("*.pt"):
            try:
                found.append(self._read_meta(path))
            except Exception as e:  # truncated, foreign or from another version
                logger.warning("disk tier: discarding %s (%s)", path.name, e)
                path.unlink(missing_ok=True)
        found.sort(key=lambda s: s.saved_at)
        while found and sum(s.nbytes for s in found) > self.capacity_bytes:
            found.pop(0).path.unlink(missing_ok=True)  # the cap may have shrunk
        return found

    def _read_meta(self, path: Path) -> SavedEntry:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        meta = json.loads(data["meta"])
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another model or configuration")
        own = {k: v for k, v in meta.items() if k not in _RESERVED}
        tokens = data["tokens"].tolist()
        size = path.stat().st_size
        return SavedEntry(path, size, meta["name"], tokens, meta["counts"], meta["saved_at"], own)

    def register(self, key: int, saved: SavedEntry) -> None:
        self._entries[key] = _Entry(saved.path, saved.nbytes, list(saved.counts))

    # -- write / read -------------------------------------------------------------------
    def write(
        self,
        key: int,
        record: DiskRecord,
        counts: list[int],
        rows: HostRows,
        state: StatePayload,
    ) -> bool:
        """Save entry `key`; False if it cannot fit under the cap even alone."""
        stem = hashlib.sha256(record.name.encode()).hexdigest()[:32]
        path, tmp = self.dir / f"{stem}.pt", self.dir / f"{stem}.tmp"
        meta = {
            **record.meta,
            "fingerprint": self.fingerprint,
            "name": record.name,
            "counts": counts,
            "saved_at": time.time(),
        }
        payload = {
            "tokens": torch.tensor(record.tokens, dtype=torch.long),
            "k": [k for k, _ in rows],  # per layer [n, Hkv, D], view order
            "v": [v for _, v in rows],
            "state": state,
            "meta": json.dumps(meta),
        }
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        nbytes = tmp.stat().st_size
        if nbytes > self.capacity_bytes:
            tmp.unlink()
            return False
        self.drop(key)
        self._make_room(nbytes)
        os.replace(tmp, path)
        self._entries[key] = _Entry(path, nbytes, list(counts))
        self.num_written += 1
        return True

    def read(self, key: int) -> tuple[HostRows, StatePayload]:
        """Entry `key`'s rows and state (tensors on the host); the entry stays."""
        self.num_read += 1
        data = torch.load(self._entries[key].path, map_location="cpu", weights_only=True)
        rows = list(zip(data["k"], data["v"]))
        return rows, cast(StatePayload, data["state"])

    def drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        while self._entries and self.used_bytes + nbytes > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self.drop(oldest)
            if self.on_evict is not None:
                self.on_evict(oldest)


_RESERVED = ("fingerprint", "name", "counts", "saved_at")  # the tier's own metadata
