"""The sparse method's side of one forward: what it asks the backend, what the backend
reports back, and the context its batched decode views read.

`ForwardBatch` (attention/backend.py) carries one as `batch.sparse`. The backend reads
the requests (`wants_scores`, `select_views`) and writes the results (`put_scores`,
`put_step_scores`); the method reads them in `select_views` and, through `row_scores`,
in `after_step`. It lives exactly as long as its forward. The method's own per-step
results live on the method, reset in `SparseMethod.begin_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    # Type-only: attention carries the sparse layer's step records and KV access to the
    # method's select_views without reading them (import-linter skips these imports).
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.sparse.base import KVAccess, SeqStep

# select_views(layer, q [S, num_heads, head_dim], batch) -> (subset [S, Hkv, B] int32,
# lens [S] or [S, Hkv] int32) context positions each sequence's single query reads, or
# None for the whole views (the contract is SparseMethod.select_views).
# observe_queries(layer, row, q [n, num_heads, head_dim], k [n, num_kv_heads, head_dim],
# scale): a row's newest n queries and their keys, post-RoPE, and the layer's attention
# scale, handed to its method (SparseMethod.observe_queries, or observe_scoring in a
# scoring pass).
ObserveQueries: TypeAlias = "Callable[[int, int, torch.Tensor, torch.Tensor, float], None]"
SelectViews: TypeAlias = (
    "Callable[[int, torch.Tensor, ForwardBatch], tuple[torch.Tensor, torch.Tensor] | None]"
)


@dataclass
class SparseStep:
    """Score requests and results, the batched decode views, and their context.

    score_rows[i] > 0 asks for the summed attention probabilities of sequence i's last
    score_rows[i] queries over its view, at score_layers (None: every layer): per row in
    scores[layer][i] as [num_heads, L_i], or, from the decode kernel, for the whole batch
    in step_scores[layer] as [S, num_heads, W] (W >= every view length; zero past a
    row's view). Read them through `row_scores` / `dense_scores`, which accept either.
    """

    # Per sequence, on the host and on the device ([S] int32): the score requests.
    score_rows: list[int]
    score_rows_t: torch.Tensor
    # Per sequence: a generation step (SeqStep.is_decode), on the device ([S] bool).
    decode_t: torch.Tensor
    # Read-only context for select_views: the runner's KV operations and the methods'
    # per-sequence step records (empty in a decode-graph capture: its rows are padding).
    kv: KVAccess
    steps: list[SeqStep] = field(default_factory=list)
    score_layers: frozenset[int] | None = None
    # A batch that mixes methods: each row's method (an opaque object the methods
    # compare themselves with, see `own_steps`) and its score layers (replacing
    # score_layers); None: one method serves every row.
    owners: list[object] | None = None
    row_score_layers: list[frozenset[int] | None] | None = None
    # Each row's method id on the device ([S] int32; what merged decode views mask by).
    method_ids_t: torch.Tensor | None = None
    # Several methods read this step's scores: one that has taken what it needs must not
    # free them for the others (drop_scores keeps them).
    shared_scores: bool = False
    # The method's batched decode views; None: every view is read whole.
    select_views: SelectViews | None = None
    # A decode-graph capture: the rows are padding standing for every later decode step,
    # so nothing may be decided from host lists that describe one real step.
    capturing: bool = False
    # Per sequence: how many of its newest queries its method takes at each layer
    # (`query_rows`), and where they go; None: no row asks (a decode graph never does).
    query_rows: list[int] = field(default_factory=list)
    observe_queries: ObserveQueries | None = None
    scores: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    step_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    # The view length of each row at a step_scores layer: where its probabilities end.
    step_score_lens: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.score_rows)

    def own_steps(self, method: object) -> list[SeqStep]:
        """The steps of the rows `method` serves (every step when one method serves all)."""
        owners = self.owners
        if owners is None:
            return self.steps
        return [st for st in self.steps if owners[st.row] is method]

    def wants_scores(self, layer: int, i: int) -> int:
        """Query rows of sequence i whose probabilities `layer` reports (0: none)."""
        if not self.score_rows[i]:
            return 0
        layers = self.score_layers if self.row_score_layers is None else self.row_score_layers[i]
        if layers is not None and layer not in layers:
            return 0
        return self.score_rows[i]

    def hand_queries(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float,
        q_starts: list[int],
        q_lens: list[int],
    ) -> None:
        """Give each asking sequence's newest queries and keys at `layer` to its method;
        q `[T, num_heads, head_dim]` and k `[T, num_kv_heads, head_dim]` are the step's
        post-RoPE ones (what the backend attends with `scale`)."""
        if self.observe_queries is None:
            return
        for i, rows in enumerate(self.query_rows):
            if rows:
                end = q_starts[i] + q_lens[i]
                self.observe_queries(layer, i, q[end - rows : end], k[end - rows : end], scale)

    def head_mean(self, per_head: torch.Tensor, dim: int) -> torch.Tensor:
        """The float32 mean over the model's query heads of scores whose `dim` holds
        this rank's heads: over tensor-parallel ranks (`kv.head_ranks()`), each sums
        its own and the sums are added (every rank gets the same result)."""
        ranks = self.kv.head_ranks()
        if ranks.reduce is None:
            return per_head.float().mean(dim)
        total = ranks.reduce(per_head.float().sum(dim).contiguous())
        return total / (per_head.shape[dim] * ranks.size)

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """A rank's partial sum (over its own heads) summed over the ranks: every rank
        gets the same tensor (itself on one rank)."""
        reduce = self.kv.head_ranks().reduce
        return partial if reduce is None else reduce(partial.contiguous())

    def put_scores(self, layer: int, i: int, value: torch.Tensor) -> None:
        """Sequence i's summed probabilities at `layer`: `[num_heads, L_i]`."""
        self.scores.setdefault(layer, [None] * self.num_seqs)[i] = value

    def put_step_scores(self, layer: int, value: torch.Tensor, view_lens: list[int]) -> None:
        """The decode kernel's probabilities of every sequence, `[S, num_heads, W]`, and
        each sequence's view length at `layer` (`[S]`)."""
        self.step_scores[layer] = value
        self.step_score_lens[layer] = view_lens

    def drop_scores(self, layer: int) -> None:
        """Free a layer's probabilities (a method that has taken what it needs); in a
        batch of several methods they stay for the others."""
        if self.shared_scores:
            return
        self.scores.pop(layer, None)
        self.step_scores.pop(layer, None)
        self.step_score_lens.pop(layer, None)

    def row_scores(self) -> dict[int, list[torch.Tensor | None]]:
        """`[layer][i]` -> `[num_heads, L_i]` where requested (None elsewhere): what
        `SparseMethod.after_step` receives. Rows of step_scores are views, valid for the
        step only (a method that keeps them must copy)."""
        out = {layer: list(rows) for layer, rows in self.scores.items()}
        for layer, dense in self.step_scores.items():
            rows = out.setdefault(layer, [None] * self.num_seqs)
            lens = self.step_score_lens[layer]
            for i in range(self.num_seqs):
                if self.wants_scores(layer, i):
                    rows[i] = dense[i, :, : lens[i]]
        return out

    def dense_scores(self, layer: int) -> torch.Tensor:
        """`[S, num_heads, W]` probabilities at a score layer, zero past each row's view
        and for rows that did not ask (per-row scores are padded and stacked)."""
        if layer in self.step_scores:
            return self.step_scores[layer]
        rows = self.scores[layer]
        ref = next(r for r in rows if r is not None)
        width = max(r.shape[-1] for r in rows if r is not None)
        out = ref.new_zeros((self.num_seqs, ref.shape[0], width), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r is not None:
                out[i, :, : r.shape[-1]] = r
        return out
