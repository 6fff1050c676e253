"""OmniKV (Hao et al., 2025): dense storage, token selection by "filter" layers.

At decode, the layers in `full_attention_layers` attend to the whole context; the
decode query's attention there (averaged over heads) picks the top
`decode_keep_tokens` tokens, and every following layer up to the next full layer
reads only those tokens. Nothing is evicted, so prefix caching stays exact.
"""

from __future__ import annotations

import torch

from sparsevllm.sparse.base import SeqStep, SparseMethod


class OmniKV(SparseMethod):
    name = "omnikv"
    uses_decode_view = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        managed = self.layers  # sliding-window layers are not OmniKV's
        n = len(managed)
        layers = self.config.full_attention_layers
        if layers is None:
            layers = sorted({managed[i] for i in (0, n // 4, n // 2, 3 * n // 4)})
        if managed[0] not in layers or not set(layers) <= set(managed):
            raise ValueError(
                f"full_attention_layers must include layer {managed[0]} and lie in the "
                f"full-attention layers {list(managed)}, got {layers}"
            )
        self.full_layers = tuple(layers)
        self.score_layers = frozenset(layers)

    def score_rows(self, step: SeqStep) -> int:
        return 1 if step.is_decode else 0

    def select_view(self, layer, row, q, batch):
        if layer in self.score_layers or not batch.score_rows[row]:
            return None
        source = max(f for f in self.full_layers if f < layer)
        picked = batch.method_cache  # per step: the picks of a full layer serve its followers
        if (source, row) not in picked:
            attn = batch.scores[source][row]  # [num_heads, L]; the last column is the query
            picked[(source, row)] = omnikv_pick(attn, self.config.decode_keep_tokens)
        return picked[(source, row)]


def omnikv_pick(attn: torch.Tensor, budget: int) -> torch.Tensor | None:
    """Top-`budget` context positions by head-averaged attention (None: read all)."""
    context = attn[:, :-1].float().mean(dim=0)
    if context.numel() <= budget:
        return None
    return context.topk(budget).indices.sort().values
