"""OmniKV (Hao et al., 2025): dense storage, token selection by "filter" layers.

At decode, the layers in `full_attention_layers` attend to the whole context; the
decode query's attention there (averaged over heads) picks the top
`decode_keep_tokens` tokens, and every following layer up to the next full layer
reads only those tokens. Nothing is evicted, so prefix caching stays exact.

`select_view` (per row) is the reference definition; the engine calls `select_views`,
which picks for the whole batch on the device from the full layer's `[S, Hq, W]`
probabilities (head mean, masked top-k), with no host synchronisation. Over
tensor-parallel ranks the head mean adds every rank's sum (`SparseStep.head_mean`), so
each rank picks the tokens one rank would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsevllm.sparse.base import MethodSettings, SeqStep, SparseMethod
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, MethodSpec, knob

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch

DEFAULT_FULL_LAYER_STRIDE = 8


@dataclass(frozen=True)
class OmniKVKnobs(MethodKnobs):
    full_attention_layers: tuple[int, ...] | None = knob(
        None,
        "OmniKV: layers that attend fully and select tokens for the layers after them "
        "(comma-separated; default: the first layer and every 8th after it).",
    )


class OmniKV(SparseMethod):
    name = "omnikv"
    knobs: OmniKVKnobs
    # The picks read the full layers' decode probabilities inside the decode graph too
    # (there the buffer spans the table width); each is dropped once its picks exist, so
    # one full layer's buffer is alive at a time. after_step reads no scores.
    decode_views = DecodeViews.GRAPH
    score_layers: frozenset[int]  # the full layers (set in __init__)

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        managed = self.layers  # sliding-window layers are not OmniKV's
        layers = self.knobs.full_attention_layers
        if layers is None:
            # One full layer per 8 managed ones (Llama-3-8B: 0, 8, 16, 24). A fixed stride,
            # not a fraction of the depth: with few managed layers (Gemma 3's global ones)
            # quarters of the depth would make every layer full, i.e. dense attention.
            layers = managed[::DEFAULT_FULL_LAYER_STRIDE]
        if managed[0] not in layers or not set(layers) <= set(managed):
            raise ValueError(
                f"full_attention_layers must include layer {managed[0]} and lie in the "
                f"full-attention layers {list(managed)}, got {layers}"
            )
        self.full_layers = tuple(layers)
        self.score_layers = frozenset(layers)
        # This step's picks of each full layer, which serve every layer up to the next
        # full one (reset in begin_step): the batch's (positions [S, B], lens [S]) by
        # full layer and, on the reference path, one row's by (full layer, row).
        self._picks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._row_picks: dict[tuple[int, int], torch.Tensor | None] = {}

    def decode_score_rows(self) -> int:
        return 1

    def prefill_score_rows(self, step: SeqStep) -> int:
        return 1 if step.is_decode else 0  # outputs computed again after a preemption

    def begin_step(self, batch: ForwardBatch) -> None:
        self._picks.clear()
        self._row_picks.clear()

    def free_device_memory(self) -> None:
        self._picks.clear()
        self._row_picks.clear()

    def select_view(
        self, layer: int, row: int, q: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | None:
        if layer in self.score_layers or not batch.sparse.score_rows[row]:
            return None
        source = max(f for f in self.full_layers if f < layer)
        key = (source, row)  # per step: a full layer's pick serves its followers
        if key not in self._row_picks:
            attn = batch.sparse.scores[source][row]  # [num_heads, L]; last column: the query
            if attn is None:
                raise RuntimeError(f"OmniKV: full layer {source} reported no scores")
            mean = batch.sparse.head_mean(attn, 0)  # [L]
            self._row_picks[key] = pick_from_mean(mean, self.config.decode_keep_tokens)
        return self._row_picks[key]

    def select_views(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Host lists only: a step where nobody decodes (or a full layer) reads everything.
        sparse = batch.sparse
        # (A captured graph's rows are padding for any later step: they all ask.)
        asking = sparse.score_rows
        if sparse.owners is not None:
            asking = [sparse.score_rows[st.row] for st in sparse.own_steps(self)]
        if layer in self.score_layers or not any(asking):
            return None
        source = max(f for f in self.full_layers if f < layer)
        if source not in self._picks:  # the picks of a full layer serve all its followers
            context = batch.view_lens_t[batch.group_of_layer[source]] - 1  # [S]
            self._picks[source] = picks_from_mean(
                sparse.head_mean(sparse.dense_scores(source), 1),
                context,
                sparse.score_rows_t,
                self.config.decode_keep_tokens,
            )
            # The picks are all that is needed of them: free the probabilities now.
            sparse.drop_scores(source)
        positions, lens = self._picks[source]  # [S, B], [S]
        # Every KV head reads the same tokens: a stride-0 head axis, no copy.
        return positions.unsqueeze(1).expand(-1, self.num_kv_heads, -1), lens


def picks_from_mean(
    avg: torch.Tensor, context: torch.Tensor, wants: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched `pick_from_mean`, device-side: top-`budget` context positions per row.

    avg `[S, W]` float32, the head-averaged probabilities (a row's columns past its view
    are ignored), context `[S]` (view length - 1), wants `[S]` (score_rows: 0 reads the
    whole view). Returns (positions `[S, budget]` int32 ascending, lens `[S]` int32):
    rows whose context fits the budget read positions 0 .. context - 1; rows that did
    not ask get lens -1.
    """
    if avg.shape[1] < budget:  # short views: pad so top-k always has `budget` columns
        avg = torch.nn.functional.pad(avg, (0, budget - avg.shape[1]), value=float("-inf"))
    cols = torch.arange(avg.shape[1], device=avg.device)  # [W']
    # The query's own column and everything past it never compete.
    avg = avg.masked_fill(cols >= context.unsqueeze(1), float("-inf"))
    top = avg.topk(budget, dim=-1).indices.sort(dim=-1).values  # [S, budget]
    fits = context <= budget  # [S]
    positions = torch.where(fits.unsqueeze(1), cols[:budget], top).to(torch.int32)
    lens = torch.where(fits, context, torch.full_like(context, budget))
    lens = torch.where(wants > 0, lens, torch.full_like(lens, -1)).to(torch.int32)
    return positions, lens


def omnikv_pick(attn: torch.Tensor, budget: int) -> torch.Tensor | None:
    """Top-`budget` context positions by head-averaged attention (None: read all)."""
    return pick_from_mean(attn.float().mean(dim=0), budget)


def pick_from_mean(mean: torch.Tensor, budget: int) -> torch.Tensor | None:
    """`omnikv_pick` from the head-averaged attention `[L]` (last entry: the query)."""
    context = mean[:-1]
    if context.numel() <= budget:
        return None
    return context.topk(budget).indices.sort().values


SPEC = MethodSpec(
    name="omnikv",
    family="logical_masking",
    description="dense storage; full-attention layers pick the tokens later layers read",
    method=OmniKV,
    knobs=OmniKVKnobs,
    budget_fields=("decode_keep_tokens",),
    budget_knob="decode_keep_tokens",
    prefix_cache=True,
)
