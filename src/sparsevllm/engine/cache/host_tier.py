"""The host-memory tier: entries' KV rows in (pinned) host tensors, oldest first, within
a byte cap (`cpu_offload_gb`). The tier stack decides what goes in and what moves on."""

from __future__ import annotations

from sparsevllm.engine.cache.kv_rows import HostRows, rows_nbytes


class HostTier:
    """Host copies of entries by key, in the order they arrived."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: dict[int, tuple[list[int], HostRows]] = {}  # key -> (counts, rows)

    def put(self, key: int, counts: list[int], rows: HostRows) -> None:
        self.take(key)
        self._entries[key] = (list(counts), rows)
        self.used_bytes += rows_nbytes(rows)

    def take(self, key: int) -> tuple[list[int], HostRows] | None:
        """Remove and return entry `key` (rows per group, rows) if held."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= rows_nbytes(entry[1])
        return entry

    def has(self, key: int) -> bool:
        return key in self._entries

    def counts(self, key: int) -> list[int]:
        return self._entries[key][0]

    def pop_oldest(self) -> tuple[int, list[int], HostRows] | None:
        """Remove the entry held longest: its key, rows per group and rows (None: empty)."""
        key = next(iter(self._entries), None)
        if key is None:
            return None
        counts, rows = self._entries.pop(key)
        self.used_bytes -= rows_nbytes(rows)
        return key, counts, rows
