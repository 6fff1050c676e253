"""Disk tier for idle chains and radix nodes: one file per entry, LRU-capped by size,
kept across restarts.

Files live in `disk_offload_dir/<fingerprint digest>/`. The fingerprint names what
shapes the KV bytes (model identity, dtype, layers, KV heads, head dim, layer groups,
sparse method and its knobs); an engine only ever reads its own directory and checks
every file's recorded fingerprint again on start, so KV written by another model or
configuration is never used. A file is written to `*.tmp`, synced and renamed, so a
crash leaves either the whole entry or a `*.tmp` leftover (removed on start).

The cap (`disk_offload_gb`) bounds the committed entries: to add one, the least
recently written entries are evicted (their chains are dropped through `on_evict`).
Restoring an entry deletes its file (the chain is resident again). One engine per
directory: two engines sharing one would evict each other's files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def kv_fingerprint(config: Any, source: Any, runner: Any, layer_groups: list[list[int]]) -> dict:
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


def _model_identity(path: str) -> dict[str, Any]:
    """The model path plus size and modification time of its weight and config files."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(p.iterdir()) if p.is_dir() else []
    stamps = {
        f.name: [f.stat().st_size, f.stat().st_mtime_ns]
        for f in files
        if f.is_file() and f.suffix in (".gguf", ".safetensors", ".bin", ".json")
    }
    return {"path": str(p), "files": stamps}


def _digest(fingerprint: dict) -> str:
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class SavedChain:
    """An entry found on disk at start: enough to register its chain."""

    path: Path
    nbytes: int
    chain_id: str
    tokens: list[int]
    counts: list[int]
    saved_at: float
    meta: dict[str, Any] = field(default_factory=dict)  # the whole recorded metadata


@dataclass
class _Entry:
    path: Path
    nbytes: int
    counts: list[int]


class DiskStore:
    def __init__(self, root: str, capacity_bytes: int, fingerprint: dict) -> None:
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as read back from a file
        self.dir = Path(root) / _digest(fingerprint)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self._entries: dict[int, _Entry] = {}  # owner -> entry, least recently written first
        self.on_evict: Callable[[int], None] | None = None
        self.num_written = 0
        self.num_read = 0

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def has(self, owner: int) -> bool:
        return owner in self._entries

    def counts(self, owner: int) -> list[int]:
        return self._entries[owner].counts

    # -- start: what an earlier engine left -----------------------------------------------
    def scan(self) -> list[SavedChain]:
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

    def _read_meta(self, path: Path) -> SavedChain:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        meta = json.loads(data["meta"])
        if meta.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another model or configuration")
        tokens = data["tokens"].tolist()
        return SavedChain(
            path,
            path.stat().st_size,
            meta["chain_id"],
            tokens,
            meta["counts"],
            meta["saved_at"],
            meta,
        )

    def register(self, owner: int, saved: SavedChain) -> None:
        self._entries[owner] = _Entry(saved.path, saved.nbytes, list(saved.counts))

    # -- write / read -------------------------------------------------------------------
    def write(
        self,
        owner: int,
        chain_id: str,
        counts: list[int],
        payload: dict,
        extra: dict[str, Any] | None = None,
    ) -> bool:
        """Save one entry (`extra`: more metadata, JSON); False if it cannot fit under
        the cap even alone."""
        name = hashlib.sha256(chain_id.encode()).hexdigest()[:32]
        path, tmp = self.dir / f"{name}.pt", self.dir / f"{name}.tmp"
        meta = {
            **(extra or {}),
            "fingerprint": self.fingerprint,
            "chain_id": chain_id,
            "counts": counts,
            "saved_at": time.time(),
        }
        with open(tmp, "wb") as f:
            torch.save({**payload, "meta": json.dumps(meta)}, f)
            f.flush()
            os.fsync(f.fileno())
        nbytes = tmp.stat().st_size
        if nbytes > self.capacity_bytes:
            tmp.unlink()
            return False
        self.drop(owner)
        self._make_room(nbytes)
        os.replace(tmp, path)
        self._entries[owner] = _Entry(path, nbytes, list(counts))
        self.num_written += 1
        return True

    def read(self, owner: int) -> dict:
        """The payload of `owner`'s entry (tensors on the host); the entry stays."""
        self.num_read += 1
        return torch.load(self._entries[owner].path, map_location="cpu", weights_only=True)

    def drop(self, owner: int) -> None:
        entry = self._entries.pop(owner, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def _make_room(self, nbytes: int) -> None:
        while self._entries and self.used_bytes + nbytes > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self.drop(oldest)
            if self.on_evict is not None:
                self.on_evict(oldest)
