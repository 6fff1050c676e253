"""DuoAttention (Xiao et al., 2024): retrieval heads keep everything, streaming heads keep
attention sinks + a recent window.

"DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads"
(arXiv 2410.10819). Every KV head of every managed layer is either a retrieval head (the
full KV cache) or a streaming head (the first S = `sink_keep_tokens` and the last R =
`recent_keep_tokens` tokens, constant memory). Which heads stream comes from per-KV-head
scores made once per model (`sparsevllm calibrate duoattention`, calibration/head_scores.py;
files for the default model and Gemma-3-270M ship with the package); the lowest-scored
heads stream:

- `duoattention_sparsity` p: n = ceil(p x (N - 1)) of the N managed heads (N for p = 1),
  the paper's rule (a head streams when its score is below the p-quantile of the scores);
- `duoattention_threshold` t (overrides p): the heads scoring below t;
- `duoattention_kv_budget` B (overrides both; the budget knob of `bench quality`): for a
  prompt of L > B tokens, the fewest heads whose streaming brings the mean over heads of
  kept tokens to B: n = ceil(N (L - B) / (L - S - R)).

What each head reads and keeps, per sequence, from the end of its prompt on:

- a retrieval head: every token;
- a streaming head: at every decode step, the first S and the last R tokens of its
  context (plus the new token), as the paper's streaming cache holds them. In a layer
  where some head retrieves, those reads are per-KV-head counts of the decode view
  (`select_views`, as Ada-KV's), and the layer's slots stay (a slot holds every head's
  K/V of a token). A layer whose heads all stream is cut to sink + recent at the prompt's
  end, and again whenever it holds more than S + R + I tokens (I =
  `duoattention_interval`): its slots are freed, and it never holds more than S + R + I
  after a step.

Differences from the paper: prefill attention is dense for every head (the engine's
prefill kernels take no per-head masks; the paper's streaming heads attend Lambda-shaped
during prefill too), so the prompt's K/V and its last logits are the dense model's; the
paper stores streaming heads apart, so their memory is freed in every layer, here only in
layers whose heads all stream. The scores are not the paper's optimised gates (see
docs/methods.md). As a pruning scorer, the cached history has no head roles: it prunes by
recency, as StreamingLLM does (what a streaming head keeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsevllm.calibration.head_scores import HeadScores, find_head_scores, read_head_scores
from sparsevllm.kv.layout import MLA_LATENT
from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep, SparseMethod
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, MethodSpec, knob
from sparsevllm.sparse.streamingllm import prune_scores, streaming_keep

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.calibration.schema import ModelIdentity


@dataclass(frozen=True)
class DuoAttentionKnobs(MethodKnobs):
    duoattention_sparsity: float = knob(
        0.5,
        "DuoAttention: fraction of the managed KV heads that stream (sink + recent); the "
        "lowest-scored ones (0: none, 1: all).",
        minimum=0,
        maximum=1,
    )
    duoattention_threshold: float | None = knob(
        None,
        "DuoAttention: heads whose score is below this stream (overrides the sparsity; the "
        "shipped scores lie in [0, 1]).",
    )
    duoattention_kv_budget: int | None = knob(
        None,
        "DuoAttention: KV tokens per head, averaged over the managed heads: a prompt longer "
        "than this streams the fewest lowest-scored heads that meet it (overrides sparsity "
        "and threshold; what bench quality's budgets set).",
        minimum=1,
    )
    duoattention_interval: int = knob(
        64,
        "DuoAttention: a layer whose heads all stream is cut back to sink + recent once it "
        "holds this many more tokens.",
        minimum=1,
    )
    duoattention_head_scores: str | None = knob(
        None,
        "DuoAttention: head-score file (sparsevllm calibrate duoattention); default: the "
        "file shipped for the loaded model.",
    )


class DuoAttention(SparseMethod):
    name = "duoattention"
    knobs: DuoAttentionKnobs
    per_layer_groups = True
    model_heads = True  # heads are ranked against every (layer, head) of the model
    decode_views = DecodeViews.EAGER
    evicts_during_decode = True

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self.sink = config.sink_keep_tokens
        self.recent = config.recent_keep_tokens
        self.interval = self.knobs.duoattention_interval
        self.head_scores: HeadScores | None = None
        self._order: list[tuple[int, int]] = []  # managed (layer, head), lowest score first
        self._masks: dict[int, dict[int, torch.Tensor]] = {}  # n -> layer -> [Hkv] bool
        path = self.knobs.duoattention_head_scores
        if path is not None:
            self.use_scores(read_head_scores(path))

    # -- which heads stream -------------------------------------------------------------
    def bind_model(self, model: ModelIdentity) -> None:
        if self.head_scores is not None:  # an explicit file: it must fit this model
            self.head_scores.check_model(model)
        else:
            self.use_scores(find_head_scores(model))

    def use_scores(self, scores: HeadScores) -> None:
        """Take `scores` (checked against this model's shape) and rank the heads."""
        scores.check_shape(self.num_layers, self.num_kv_heads, self.layers)
        self.head_scores = scores
        pairs = [(layer, h) for layer in self.layers for h in range(self.num_kv_heads)]
        self._order = sorted(pairs, key=lambda p: (self._score(*p), p))
        self._masks.clear()

    def _score(self, layer: int, head: int) -> float:
        assert self.head_scores is not None
        row = self.head_scores.scores[layer]
        assert row is not None
        return row[head]

    def _ranked(self) -> list[tuple[int, int]]:
        if self.head_scores is None:
            raise ValueError(
                "duoattention has no head scores: give duoattention_head_scores=FILE "
                "(made by `sparsevllm calibrate duoattention`)"
            )
        return self._order

    def num_streaming(self, prompt_len: int) -> int:
        """How many managed heads stream for a prompt of `prompt_len` tokens."""
        order = self._ranked()
        total = len(order)
        k = self.knobs
        if k.duoattention_kv_budget is not None:
            keep = min(prompt_len, self.sink + self.recent)
            if prompt_len <= k.duoattention_kv_budget or prompt_len <= keep:
                return 0
            need = total * (prompt_len - k.duoattention_kv_budget) / (prompt_len - keep)
            return min(total, math.ceil(need - 1e-9))
        if k.duoattention_threshold is not None:
            return sum(self._score(*p) < k.duoattention_threshold for p in order)
        return streaming_count(total, k.duoattention_sparsity)

    def streaming_heads(self, prompt_len: int) -> dict[int, torch.Tensor]:
        """Per managed layer with a streaming head, which KV heads stream `[Hkv]` bool."""
        n = self.num_streaming(prompt_len)
        if n not in self._masks:
            masks: dict[int, torch.Tensor] = {}
            for layer, h in self._ranked()[:n]:
                masks.setdefault(layer, torch.zeros(self.num_kv_heads, dtype=torch.bool))[h] = True
            self._masks[n] = masks
        return self._masks[n]

    def _all_streaming_layers(self, prompt_len: int) -> list[int]:
        return [layer for layer, m in self.streaming_heads(prompt_len).items() if bool(m.all())]

    # -- admission ----------------------------------------------------------------------
    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        full = prompt_len + max_tokens
        if len(self._all_streaming_layers(prompt_len)) < len(self.layers):
            return full  # a layer with a retrieval head keeps everything
        chunk = max(self.config.chunk_prefill_size, 1)
        return min(full, max(prompt_len + chunk, self.sink + self.recent + self.interval + chunk))

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        full = prompt_len + max_tokens
        if len(self._all_streaming_layers(prompt_len)) < len(self.layers):
            return full
        return min(full, self.sink + self.recent + self.interval)

    # -- eviction -----------------------------------------------------------------------
    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        window = self.sink + self.recent
        for step in steps:
            if not (step.finishes_prompt or step.is_decode):
                continue  # mid-prompt chunks keep everything: the cut is at the prompt's end
            limit = window if step.finishes_prompt else window + self.interval
            for layer in self._all_streaming_layers(step.prompt_len):
                length = kv.resident(step.seq_id, layer)
                if length > limit:
                    keep = streaming_keep(length, self.sink, self.recent)
                    kv.keep(step.seq_id, kv.group_of(layer), keep)

    # -- decode reads -------------------------------------------------------------------
    def select_views(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        group = batch.group_of_layer[layer]
        rows: list[int] = []
        contexts: list[int] = []
        masks: list[torch.Tensor] = []
        for step in batch.sparse.own_steps(self):
            mask = self.streaming_heads(step.prompt_len).get(layer)
            if mask is None or batch.q_lens[step.row] != 1:
                continue
            rows.append(step.row)
            contexts.append(batch.view_lens[group][step.row] - 1)  # the view minus the new token
            masks.append(mask)
        if not rows:
            return None
        dev = q.device  # built there: a retrieval head's positions span its whole context
        subset, counts = streaming_views(
            torch.tensor(contexts, device=dev), torch.stack(masks).to(dev), self.sink, self.recent
        )
        shape = (len(batch.q_lens), self.num_kv_heads)
        out = torch.zeros((*shape, subset.shape[-1]), dtype=torch.int32, device=dev)
        lens = torch.full(shape, -1, dtype=torch.int32, device=dev)
        index = torch.tensor(rows, device=dev)
        out[index], lens[index] = subset, counts
        return out, lens


def streaming_count(num_heads: int, sparsity: float) -> int:
    """Heads that stream at `sparsity`: those below the `sparsity`-quantile of distinct
    scores (linear interpolation, as the paper's `np.quantile`), all of them at 1."""
    if sparsity >= 1:
        return num_heads
    return min(num_heads, math.ceil(sparsity * (num_heads - 1) - 1e-9))


def streaming_views(
    contexts: torch.Tensor, streaming: torch.Tensor, sink: int, recent: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode reads of rows with `contexts` `[R]` entries before the new token and heads
    `streaming` `[R, Hkv]` bool -> (positions `[R, Hkv, W]` int32 ascending, counts
    `[R, Hkv]` int32): a retrieval head reads its whole context, a streaming head its
    first `sink` and last `recent` entries (everything when the context is no longer)."""
    width = max(int(contexts.max()), 1)
    col = torch.arange(width, device=contexts.device)[None, :]  # [1, W]
    ctx = contexts[:, None]  # [R, 1]
    cut = (col >= sink) & (ctx > sink + recent)
    tail = torch.where(cut, col + ctx - sink - recent, col)  # [R, W]
    subset = torch.where(streaming[:, :, None], tail[:, None, :], col[:, None, :])
    counts = torch.where(streaming, contexts.clamp(max=sink + recent)[:, None], ctx)
    return subset.to(torch.int32), counts.to(torch.int32)


SPEC = MethodSpec(
    name="duoattention",
    family="physical_eviction",
    description="retrieval heads (by calibrated head scores) keep every token, streaming "
    "heads keep sink + recent; layers whose heads all stream are cut and freed",
    method=DuoAttention,
    knobs=DuoAttentionKnobs,
    budget_fields=("sink_keep_tokens", "recent_keep_tokens"),
    budget_knob="duoattention_kv_budget",
    chain_cache=True,
    prune_scorer=prune_scores,
    refused_layouts={
        MLA_LATENT: "its head scores are per KV head of a per-head K/V layout, and a latent "
        "row serves every query head (no calibration for latent KV)"
    },
)
