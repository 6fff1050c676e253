"""The disk tier: one file per entry (idle chain or radix node), LRU-capped by size,
kept across restarts.

Files live in `disk_offload_dir/<fingerprint digest>/`. The fingerprint names what
shapes the KV bytes (format version, model identity, dtype, KV storage format, layers,
KV heads, head dim, layer groups, sparse method and its knobs, and which store wrote
them); an engine only
ever reads its own directory and checks every file's recorded fingerprint again on
start, so KV written by another model, configuration or format is never used. A file is
written to `*.tmp`, synced, renamed and the directory synced, so a crash (even SIGKILL
mid-write) leaves either the whole entry or a `*.tmp` leftover (removed on start). Every
file records a digest of its tokens and K/V bytes, checked when it is read: a file
damaged after it was written is discarded with a log line, never restored.

Files are named by a hash of the entry's name (a client's chain id among them), so no
request field ever becomes a path. A disk that is full, read-only or gone degrades the
tier: the entry is not kept (one warning says why, and again after a write succeeds),
and serving goes on.

A file holds the entry's logical tokens, its KV rows per layer (view order; every
buffer of the storage format, in the stored form), the
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
from sparsevllm.kv.format import SHARED_PREFIX

if TYPE_CHECKING:
    from sparsevllm.config import EngineConfig
    from sparsevllm.engine.runner import ModelRunner
    from sparsevllm.models.loader import ModelSource

logger = logging.getLogger(__name__)

# 2: one layout for both stores (rows, "state", the entry's "name" in the metadata).
# 3: rows per layer are the storage format's buffers by name ("rows"), not "k" and "v".
FORMAT_VERSION = 3


def kv_fingerprint(
    config: EngineConfig, source: ModelSource, runner: ModelRunner, layer_groups: list[list[int]]
) -> dict[str, object]:
    """What must match for saved KV to be reused bit-for-bit by this engine."""
    method = runner.method
    # A tensor-parallel rank saves its own heads' shard, in a directory of its own.
    shard = {"tensor_parallel": [runner.tp.rank, runner.tp.size]} if runner.tp.active else {}
    return {
        **shard,
        "format": FORMAT_VERSION,
        "model": _model_identity(source.path),
        "load_format": source.load_format,
        # Dummy weights come from the seed.
        "weights_seed": config.seed if source.load_format == "dummy" else None,
        "dtype": str(runner.dtype),
        "kv_cache_dtype": runner.kv_format.name,
        # KIVI's codes depend on the group size (the residual is sealed before saving).
        "kv_quant_group_size": config.kv_quant_group_size,
        "num_layers": runner.num_layers,
        "num_kv_heads": runner.num_kv_heads,
        "head_dim": runner.head_dim,
        "layer_groups": layer_groups,
        "sparse_method": config.sparse_method,
        "knobs": method.knob_values(),
        # Chains of every served method may be saved: each file names its choice.
        "sparse_methods": list(config.sparse_methods),
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


class CorruptEntry(ValueError):
    """A disk tier file that cannot be read back as written (truncated, damaged)."""


def payload_digest(tokens: torch.Tensor, rows: HostRows) -> str:
    """A digest of an entry's tokens and KV bytes (what a torn or damaged file changes)."""
    h = hashlib.blake2b(digest_size=16)
    tensors = [tokens] + [layer[name] for layer in rows for name in sorted(layer)]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
        self.num_write_errors = 0
        self._failing = False  # the last write failed (warned once until one succeeds)

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
            _unlink(tmp)  # an interrupted write: never read
        found = []
        for path in self.dir.glob("*.pt"):
            try:
                found.append(self._read_meta(path))
            except Exception as e:  # truncated, foreign or from another version
                logger.warning("disk tier: discarding %s (%s)", path.name, e)
                _unlink(path)
        found.sort(key=lambda s: s.saved_at)
        while found and sum(s.nbytes for s in found) > self.capacity_bytes:
            _unlink(found.pop(0).path)  # the cap may have shrunk
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
        """Save entry `key`; False if it cannot fit under the cap even alone, or the
        disk refused it (full, read-only: logged)."""
        stem = hashlib.sha256(record.name.encode()).hexdigest()[:32]
        path, tmp = self.dir / f"{stem}.pt", self.dir / f"{stem}.tmp"
        tokens = torch.tensor(record.tokens, dtype=torch.long)
        meta = {
            **record.meta,
            "fingerprint": self.fingerprint,
            "name": record.name,
            "counts": counts,
            "saved_at": time.time(),
            "digest": payload_digest(tokens, rows),
        }
        payload = {"tokens": tokens, "rows": rows, "state": state, "meta": json.dumps(meta)}
        try:
            nbytes = _write_synced(tmp, payload)
            if nbytes > self.capacity_bytes:
                _unlink(tmp)
                return False
            self.drop(key)
            self._make_room(nbytes)
            os.replace(tmp, path)
            _sync_dir(self.dir)
        except OSError as e:
            self._write_failed(tmp, e)
            return False
        if self._failing:
            logger.warning("disk tier: writing to %s works again", self.dir)
            self._failing = False
        self._entries[key] = _Entry(path, nbytes, list(counts))
        self.num_written += 1
        return True

    def _write_failed(self, tmp: Path, error: OSError) -> None:
        self.num_write_errors += 1
        _unlink(tmp)
        if not self._failing:
            logger.warning(
                "disk tier: cannot write to %s (%s); entries that do not fit in memory are "
                "dropped until a write succeeds, serving goes on",
                self.dir,
                error,
            )
        self._failing = True

    def read(self, key: int) -> tuple[HostRows, StatePayload]:
        """Entry `key`'s rows and state (tensors on the host); the entry stays. Raises
        CorruptEntry when the file is not what was written (its digest, its rows)."""
        self.num_read += 1
        entry = self._entries[key]
        try:
            data = torch.load(entry.path, map_location="cpu", weights_only=True)
            meta = json.loads(data["meta"])
            rows = cast(HostRows, list(data["rows"]))
            digest = payload_digest(data["tokens"], rows)
        except Exception as e:  # truncated, unreadable, gone
            raise CorruptEntry(f"{entry.path.name} cannot be read: {e}") from e
        if digest != meta.get("digest"):
            raise CorruptEntry(f"{entry.path.name} does not hold what was written")
        per_slot = (
            t for layer in rows for n, t in layer.items() if not n.startswith(SHARED_PREFIX)
        )
        if any(len(t) not in entry.counts for t in per_slot):
            raise CorruptEntry(f"{entry.path.name} has rows for other slot counts")
        return rows, cast(StatePayload, data["state"])

    def drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            _unlink(entry.path)

    def _make_room(self, nbytes: int) -> None:
        while self._entries and self.used_bytes + nbytes > self.capacity_bytes:
            oldest = next(iter(self._entries))
            self.drop(oldest)
            if self.on_evict is not None:
                self.on_evict(oldest)


_RESERVED = ("fingerprint", "name", "counts", "saved_at", "digest")  # the tier's own metadata


def _write_synced(path: Path, payload: dict[str, object]) -> int:
    """Write `payload` to `path` and fsync it; returns its size in bytes."""
    with open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _sync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a crash after it keeps the new name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:  # a read-only disk keeps it; the next start tries again
        logger.warning("disk tier: cannot delete %s (%s)", path.name, e)
