"""Quest's page bounds for a whole batch: a device page pool plus a page table.

Device state (allocated on first use):

- per sparse layer, `bounds[layer]`: `[capacity, 2, Hkv, D]` element-wise (min, max) of
  each page's keys, in the KV dtype (a min or max of stored keys is exact in it);
- `table`: `[num_rows, max_len // page_size]` int32 page ids, indexed by the slot-table
  row of a sequence (so a decode step needs no per-step upload to find its pages).

Host state: each sequence's page ids in view order, and which sequence last wrote each
table row. A page is keyed by its slot ids: its bounds depend on those slots' keys only,
so sequences sharing a radix-cached prefix share its pages (computed once, refcounted,
freed with the last sequence holding them). While a sequence holds a page its slots stay
in its view and are never rewritten, so a shared entry cannot go stale.

Capacity starts at num_slots // page_size + num_rows (every slot in at most one full page,
plus pages that straddle a radix branch) and doubles if ever exceeded.
"""

from __future__ import annotations

import logging

import torch

from sparsevllm.sparse.base import KVAccess
from sparsevllm.upload import upload

logger = logging.getLogger(__name__)

# Pages whose bounds are computed per gather: 4096 pages of 16 keys of 8 x 128 bf16 gather
# 128 MiB per layer at once.
_CHUNK_PAGES = 4096


class QuestPages:
    def __init__(self, layers: tuple[int, ...], page_size: int) -> None:
        self.layers = layers
        self.page_size = page_size
        self.bounds: dict[int, torch.Tensor] = {}  # layer -> [capacity, 2, Hkv, D]
        self.table: torch.Tensor | None = None  # [num_rows, max_pages] int32
        self._seq_pages: dict[int, list[int]] = {}  # seq_id -> page ids, view order
        self._owner: dict[int, int] = {}  # table row -> seq_id whose pages it holds
        self._by_key: dict[tuple[int, ...], int] = {}  # slot ids -> page id
        self._key: dict[int, tuple[int, ...]] = {}  # page id -> slot ids
        self._refs: dict[int, int] = {}  # page id -> sequences holding it
        self._free: list[int] = []
        self.epoch = 0  # bumped when `bounds` are reallocated (graphs hold their addresses)

    @property
    def capacity(self) -> int:
        return 0 if not self.bounds else next(iter(self.bounds.values())).shape[0]

    def num_pages(self, seq_id: int) -> int:
        return len(self._seq_pages.get(seq_id, ()))

    def pages_in_use(self) -> int:
        return len(self._refs)

    def allocate(self, kv: KVAccess, table_shape: tuple[int, int]) -> None:
        """Create the table and the initial page pool now rather than on first use."""
        if self.table is None:
            self.table = torch.zeros(table_shape, dtype=torch.int32, device=kv.device)
        if not self.bounds:
            self._grow(kv)

    def update(
        self,
        kv: KVAccess,
        need: list[tuple[int, int, int]],
        table_shape: tuple[int, int],
        device: torch.device,
    ) -> None:
        """Make table row `row` list the first `full` pages of `seq_id`'s view, for every
        (seq_id, row, full) in `need`; compute the bounds of pages new to the pool."""
        if self.table is None:
            self.table = torch.zeros(table_shape, dtype=torch.int32, device=device)
        writes: list[tuple[int, int, int]] = []  # (row, index, page id)
        new: list[tuple[int, tuple[int, ...]]] = []  # (page id, slots) to compute
        for seq_id, row, full in need:
            pages = self._seq_pages.setdefault(seq_id, [])
            while len(pages) > full:  # the view shrank (not expected for Quest): forget
                self._unref(pages.pop())
            start = 0 if self._owner.get(row) != seq_id else len(pages)
            self._owner[row] = seq_id
            if len(pages) < full:
                size = self.page_size
                slots = kv.view_slots(seq_id, self.layers[0], len(pages) * size, full * size)
                for j in range(0, len(slots), size):
                    pages.append(self._ref(tuple(slots[j : j + size]), new, kv))
            writes += [(row, j, pages[j]) for j in range(start, len(pages))]
        if new:
            self._compute(kv, new, device)
        if writes:
            rows, idx, ids = zip(*writes)
            flat = upload(
                [r * self.table.shape[1] + j for r, j in zip(rows, idx)], torch.long, device
            )
            self.table.view(-1).index_copy_(0, flat, upload(list(ids), torch.int32, device))

    def release(self, seq_id: int) -> None:
        for page in self._seq_pages.pop(seq_id, []):
            self._unref(page)
        for row in [r for r, s in self._owner.items() if s == seq_id]:
            del self._owner[row]

    def _ref(
        self, key: tuple[int, ...], new: list[tuple[int, tuple[int, ...]]], kv: KVAccess
    ) -> int:
        page = self._by_key.get(key)
        if page is None:
            if not self._free:
                self._grow(kv)
            page = self._free.pop()
            self._by_key[key], self._key[page], self._refs[page] = page, key, 0
            new.append((page, key))
        self._refs[page] += 1
        return page

    def _unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            del self._refs[page], self._by_key[self._key.pop(page)]
            self._free.append(page)

    def _grow(self, kv: KVAccess) -> None:
        """First use: num_slots // page_size + table rows pages; later: double."""
        if self.table is None:
            raise RuntimeError("the page table is made before the page pool")
        old = self.capacity
        size = old * 2 if old else kv.num_slots // self.page_size + self.table.shape[0]
        for layer in self.layers:
            k = kv.gather_keys(layer, self.table.new_zeros(0, dtype=torch.long))  # [0, Hkv, D]
            bounds = k.new_zeros((size, 2, *k.shape[1:]))
            if old:
                bounds[:old] = self.bounds[layer]
            self.bounds[layer] = bounds
        if old:
            self.epoch += 1
            logger.warning("Quest page pool grew from %d to %d pages", old, size)
        self._free.extend(range(size - 1, old - 1, -1))

    def _compute(
        self, kv: KVAccess, new: list[tuple[int, tuple[int, ...]]], device: torch.device
    ) -> None:
        """Bounds of new pages at every sparse layer: one gather + min/max per layer (in
        chunks, so a batch entering decode after long prompts stays within memory)."""
        for start in range(0, len(new), _CHUNK_PAGES):
            part = new[start : start + _CHUNK_PAGES]
            ids = upload([page for page, _ in part], torch.long, device)  # [N]
            slots = upload([s for _, key in part for s in key], torch.long, device).view(
                len(part), -1
            )
            for layer in self.layers:
                keys = kv.gather_keys(layer, slots)  # [N, size, Hkv, D]
                lo, hi = torch.aminmax(keys, dim=1)  # 2 x [N, Hkv, D]
                self.bounds[layer][ids] = torch.stack([lo, hi], dim=1)
