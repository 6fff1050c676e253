"""Quest (Tang et al., 2024): query-aware page selection at decode.

The context is split into pages of `quest_chunk_size` tokens; each page keeps the
element-wise min and max of its keys per KV head. A decode query scores a page by
the upper bound of q.k over the page, sum over d of max(q_d * max_d, q_d * min_d),
summed over the query heads of each KV head, and reads only the best pages within
`decode_keep_tokens` (the newest, partly filled page always included). The first
`quest_skip_layers` (full-attention) layers and all prefill stay dense; storage is
never touched.
"""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import SparseMethod


class Quest(SparseMethod):
    name = "quest"
    uses_decode_view = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # (seq_id, layer) -> (page_min, page_max), each [P, Hkv, D], full pages only
        self._pages: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._dense_layers = frozenset(self.layers[: self.config.quest_skip_layers])

    def select_view(self, layer, row, q, batch):
        step = batch.steps[row]
        if layer in self._dense_layers or not step.is_decode:
            return None
        size, budget = self.config.quest_chunk_size, self.config.decode_keep_tokens
        context = batch.kv.resident(step.seq_id, layer) - 1  # the new token is read anyway
        if context <= budget:
            return None
        pmin, pmax = self._update_pages(step.seq_id, layer, context, batch.kv)
        full = context // size
        tail = torch.arange(full * size, context, device=q.device)
        n_pages = max(0, (budget - tail.numel()) // size)
        scores = page_scores(q, pmin[:full], pmax[:full], self.num_kv_heads)  # [Hkv, full]
        return quest_positions(scores, n_pages, size, tail)

    def _update_pages(self, seq_id, layer, context, kv):
        size = self.config.quest_chunk_size
        pmin, pmax = self._pages.get((seq_id, layer), (None, None))
        done = 0 if pmin is None else pmin.shape[0]
        full = context // size
        if full > done:
            keys = kv.keys(seq_id, layer, done * size, full * size)  # [n*size, Hkv, D]
            keys = keys.float().view(full - done, size, *keys.shape[1:])
            new_min, new_max = keys.amin(dim=1), keys.amax(dim=1)
            pmin = new_min if pmin is None else torch.cat([pmin, new_min])
            pmax = new_max if pmax is None else torch.cat([pmax, new_max])
            self._pages[(seq_id, layer)] = (pmin, pmax)
        return pmin, pmax

    def release(self, seq_id: int) -> None:
        for key in [k for k in self._pages if k[0] == seq_id]:
            del self._pages[key]


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
