"""Quest (Tang et al., 2024): query-aware page selection at decode.

The context is split into pages of `quest_chunk_size` tokens; each page keeps the
element-wise min and max of its keys per KV head. A decode query scores a page by
the upper bound of q.k over the page, sum over d of max(q_d * max_d, q_d * min_d),
summed over the query heads of each KV head, and reads only the best pages within
`decode_keep_tokens` (the newest, partly filled page always included). The first
`quest_skip_layers` (full-attention) layers and all prefill stay dense; storage is
never touched.

`select_view` (per row, with a per-sequence page cache) is the reference definition.
The engine runs the batched path: `begin_step` (host side) brings the shared page pool
and page table up to date for the step's decode rows (`quest_pages.QuestPages`), then
`select_views` scores every row's pages, takes a masked top-k and expands it to
positions on the device, with no host synchronisation and a width fixed by the config
(decode_keep_tokens, or quest_chunk_size - 1 if larger: the tail is always read whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsevllm.sparse.base import KVAccess, MethodSettings, SparseMethod
from sparsevllm.sparse.quest_pages import QuestPages
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, MethodSpec, knob

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch


@dataclass(frozen=True)
class QuestKnobs(MethodKnobs):
    quest_chunk_size: int = knob(16, "Quest: tokens per page scored by key min/max.", minimum=1)
    quest_skip_layers: int = knob(2, "Quest: the first layers stay dense.", minimum=0)


class Quest(SparseMethod):
    name = "quest"
    knobs: QuestKnobs
    # select_views is sync-free with config/shape-sized outputs and reads the page pool
    # and table, allocated before capture; a pool that grows bumps graph_epoch.
    decode_views = DecodeViews.GRAPH
    # Pages are keyed by the slot ids of the first sparse layer, standing for all.
    finer_groups_ok = False

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        # (seq_id, layer) -> (page_min, page_max), each [P, Hkv, D], full pages only
        self._pages: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._dense_layers = frozenset(self.layers[: self.knobs.quest_skip_layers])
        sparse = tuple(la for la in self.layers if la not in self._dense_layers)
        self.pages = QuestPages(sparse, self.knobs.quest_chunk_size) if sparse else None
        # This step (set by begin_step): some decode row needs pages. A captured graph
        # has no such host flag: it always selects.
        self._active = True

    def state_bytes_per_slot(self, kv_bytes_per_layer_slot: int) -> float:
        # Per sparse layer a page of `size` slots keeps two key rows (min, max).
        n = len(self.pages.layers) if self.pages else 0
        return n * kv_bytes_per_layer_slot / self.knobs.quest_chunk_size

    def begin_step(self, batch: ForwardBatch) -> None:
        self._active = True
        if self.pages is None or batch.sparse.capturing:
            return
        size, budget = self.knobs.quest_chunk_size, self.config.decode_keep_tokens
        group = batch.group_of_layer[self.pages.layers[0]]
        need: list[tuple[int, int, int]] = []  # (seq_id, table row, full pages) past budget
        for step in batch.sparse.own_steps(self):
            i = step.row
            context = batch.view_lens[group][i] - 1
            if step.is_decode and batch.q_lens[i] == 1 and context > budget:
                need.append((step.seq_id, batch.rows[i], context // size))
        self._active = bool(need)
        if need:
            _, rows, max_len = batch.tables.shape
            shape = (rows, max_len // size)
            self.pages.update(batch.sparse.kv, need, shape, batch.rows_t.device)

    def prepare_graph_capture(self, kv: KVAccess, num_rows: int, max_len: int) -> None:
        if self.pages is not None:
            self.pages.allocate(kv, (num_rows, max_len // self.knobs.quest_chunk_size))

    @property
    def graph_epoch(self) -> int:
        return self.pages.epoch if self.pages is not None else 0

    def select_views(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Host flag from begin_step: a step with no row past the budget reads everything.
        # A captured graph always selects (rows within the budget read their whole
        # context either way).
        if layer in self._dense_layers or not self._active:
            return None
        pages = self.pages
        if pages is None or pages.table is None:  # no sparse layer, or no pages needed yet
            return None
        size = self.knobs.quest_chunk_size
        context = batch.view_lens_t[batch.group_of_layer[layer]] - 1  # [S]
        table = pages.table[batch.rows_t.long()]  # [S, P] page ids
        full = torch.div(context, size, rounding_mode="floor")  # [S] full pages
        scores = batched_page_scores(q, pages.bounds[layer], table, full)  # [S, Hkv, P]
        subset, lens = quest_views(scores, context, size, self.config.decode_keep_tokens)
        # Prefill rows (a one-token chunk) read their whole view.
        return subset, torch.where(batch.sparse.decode_t, lens, torch.full_like(lens, -1))

    def select_view(
        self, layer: int, row: int, q: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | None:
        step, kv = batch.sparse.steps[row], batch.sparse.kv
        if layer in self._dense_layers or not step.is_decode:
            return None
        size, budget = self.knobs.quest_chunk_size, self.config.decode_keep_tokens
        context = kv.resident(step.seq_id, layer) - 1  # the new token is read anyway
        full = context // size
        # Within the budget, or no full page yet: the whole context is read (the tail
        # always is, whole).
        if context <= budget or full == 0:
            return None
        pmin, pmax = self._update_pages(step.seq_id, layer, full, kv)
        tail = torch.arange(full * size, context, device=q.device)
        n_pages = max(0, (budget - tail.numel()) // size)
        scores = page_scores(q, pmin[:full], pmax[:full], self.num_kv_heads)  # [Hkv, full]
        return quest_positions(scores, n_pages, size, tail)

    def _update_pages(
        self, seq_id: int, layer: int, full: int, kv: KVAccess
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(page_min, page_max) `[>= full, Hkv, D]` of the view's pages, the first `full`
        (>= 1) computed."""
        size = self.knobs.quest_chunk_size
        cached = self._pages.get((seq_id, layer))
        done = 0 if cached is None else cached[0].shape[0]
        if cached is not None and full <= done:
            return cached
        keys = kv.keys(seq_id, layer, done * size, full * size)  # [n*size, Hkv, D]
        keys = keys.float().view(full - done, size, *keys.shape[1:])
        pmin, pmax = keys.amin(dim=1), keys.amax(dim=1)
        if cached is not None:
            pmin, pmax = torch.cat([cached[0], pmin]), torch.cat([cached[1], pmax])
        self._pages[(seq_id, layer)] = (pmin, pmax)
        return pmin, pmax

    def release(self, seq_id: int) -> None:
        for key in [k for k in self._pages if k[0] == seq_id]:
            del self._pages[key]
        if self.pages is not None:
            self.pages.release(seq_id)

    def free_device_memory(self) -> None:
        if self.pages is not None:
            self.pages = QuestPages(self.pages.layers, self.pages.page_size)


def page_scores(
    q: torch.Tensor, pmin: torch.Tensor, pmax: torch.Tensor, num_kv_heads: int
) -> torch.Tensor:
    """Upper bound of q.k per page: q `[Hq, D]`, pmin/pmax `[P, Hkv, D]` -> `[Hkv, P]`."""
    hq, d = q.shape
    qg = q.float().view(num_kv_heads, hq // num_kv_heads, 1, d)  # [Hkv, G, 1, D]
    lo = pmin.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, P, D]
    hi = pmax.permute(1, 0, 2).unsqueeze(1)
    bound = torch.maximum(qg * lo, qg * hi).sum(dim=-1)  # [Hkv, G, P]
    return bound.sum(dim=1)


def quest_positions(
    scores: torch.Tensor, n_pages: int, size: int, tail: torch.Tensor
) -> torch.Tensor:
    """`[Hkv, n_pages * size + len(tail)]` ascending positions: best pages + the tail."""
    hkv, total = scores.shape
    n_pages = min(n_pages, total)
    pages = scores.topk(n_pages, dim=-1).indices.sort(dim=-1).values  # [Hkv, n]
    offsets = torch.arange(size, device=scores.device)
    pos = (pages.unsqueeze(-1) * size + offsets).reshape(hkv, n_pages * size)
    return torch.cat([pos, tail.to(pos.device).expand(hkv, -1)], dim=-1)


def batched_page_scores(
    q: torch.Tensor, bounds: torch.Tensor, table: torch.Tensor, full: torch.Tensor
) -> torch.Tensor:
    """`page_scores` for a batch: q `[S, Hq, D]`, bounds `[capacity, 2, Hkv, D]` (min,
    max), table `[S, P]` page ids, full `[S]` valid pages -> `[S, Hkv, P]` float32,
    -inf past each row's `full`.

    max(q_d * lo_d, q_d * hi_d) = relu(q_d) * hi_d + min(q_d, 0) * lo_d as lo <= hi, so
    the G query heads of a KV head fold into two `[D]` vectors before touching pages.
    """
    s, hq, d = q.shape
    hkv = bounds.shape[2]
    qg = q.float().view(s, hkv, hq // hkv, d)  # [S, Hkv, G, D]
    q_pos = qg.clamp(min=0).sum(dim=2)  # [S, Hkv, D]
    q_neg = qg.clamp(max=0).sum(dim=2)
    if q.is_cuda:  # the pool read through the page table, without a gathered copy
        from sparsevllm.attention.triton.quest import quest_batch_scores

        return quest_batch_scores(q_pos, q_neg, bounds, table, full)
    pages = bounds[table.long()].float()  # [S, P, 2, Hkv, D]
    scores = torch.einsum("shd,sphd->shp", q_pos, pages[:, :, 1])
    scores += torch.einsum("shd,sphd->shp", q_neg, pages[:, :, 0])
    valid = torch.arange(table.shape[1], device=q.device) < full.unsqueeze(1)  # [S, P]
    return scores.masked_fill(~valid.unsqueeze(1), float("-inf"))


def quest_views(
    scores: torch.Tensor, context: torch.Tensor, size: int, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `quest_positions` with select_view's budget rule, device-side.

    scores `[S, Hkv, P]` (-inf past each row's full pages), context `[S]`. Row s reads
    its best n_s = min(full_s, (budget - tail_s) // size) pages ascending, then its tail
    (the partial newest page); a context within the budget reads everything. Returns
    (subset `[S, Hkv, max(budget, size - 1)]` int32, lens `[S]` int32); entries past
    lens are unspecified.
    """
    s, hkv, num_pages = scores.shape
    full = torch.div(context, size, rounding_mode="floor")  # [S]
    tail = context - full * size
    n_pages = torch.minimum((budget - tail).div(size, rounding_mode="floor").clamp(min=0), full)
    taken = (n_pages * size).view(s, 1, 1)  # [S, 1, 1] positions from pages
    # The tail is read whole even when it alone exceeds a budget below a page.
    j = torch.arange(max(budget, size - 1, 1), device=scores.device)  # [B]
    k = min(budget // size, num_pages)  # most pages any row can take: fixed by the config
    if k > 0:
        top = scores.topk(k, dim=-1).indices  # [S, Hkv, k] best first
        rank = torch.arange(k, device=scores.device)
        # Keep each row's n best; dropped ranks become `num_pages` and sort last.
        top = torch.where(rank < n_pages.view(s, 1, 1), top, num_pages).sort(dim=-1).values
        page = top.gather(-1, (j // size).clamp(max=k - 1).expand(s, hkv, -1))  # [S, Hkv, B]
        from_pages = page * size + j % size
    else:
        from_pages = torch.zeros((s, hkv, j.numel()), dtype=torch.long, device=scores.device)
    from_tail = (full * size).view(s, 1, 1) + j - taken  # [S, 1, B]
    pos = torch.where(j < taken, from_pages, from_tail)  # [S, Hkv, B]
    fits = (context <= budget).view(s, 1, 1)
    pos = torch.where(fits, j, pos).to(torch.int32)
    lens = torch.where(fits.view(s), context, n_pages * size + tail).to(torch.int32)
    return pos, lens


SPEC = MethodSpec(
    name="quest",
    family="query_aware_selection",
    description="page min/max keys; decode reads only the pages the query scores highest",
    method=Quest,
    knobs=QuestKnobs,
    budget_fields=("decode_keep_tokens",),
    budget_knob="decode_keep_tokens",
    prefix_cache=True,
)
