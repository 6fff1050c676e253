"""Ada-KV (Feng et al., 2024): SnapKV's votes, the layer's budget shared by its KV heads.

"Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference" (arXiv 2407.11550). A uniform budget gives every head the same number of
tokens although some heads concentrate their attention on a few tokens and others
spread it. Ada-KV keeps the layer's total (B tokens per KV head, B x Hkv pairs) and
lets the heads compete for it: the pairs with the highest scores over all heads of the
layer are kept, so heads get different counts.

Rule, per layer, at the end of the prompt, with B = `decode_keep_tokens`, S sink and R
recent tokens (always kept by every head) and m = B - S - R:

1. Each resident token gets SnapKV's pooled window vote per KV head (`snapkv_*` knobs).
2. Safeguard: each head keeps at least its n_safe = floor(alpha x m) best middle tokens
   (at least 1 when alpha > 0), alpha = `adakv_alpha_safeguard`.
3. The m x Hkv middle (head, token) pairs kept are the safeguarded ones plus the best of
   the rest over all heads of the layer jointly: head h keeps n_h, sum_h n_h = m x Hkv.

Storage: one slot holds a token's K/V of every KV head, so the compacted view has
S + max_h n_h + R rows. Head h's rows beyond its own S + n_h + R hold its next best
tokens; decode queries never read them: `select_views` gives each head its own rows
(per-head counts) plus the generated tokens. Queries of several new tokens (a prompt
continuing the chain, outputs computed again after a preemption are recompressed
first) read every kept row, a superset of the selection. Admission counts the worst
case, S + R + min(L - S - R, m x Hkv - (Hkv - 1) x n_safe) rows per layer.

Difference from the paper: the paper stores heads separately (flattened, variable
length), so memory is exactly B x Hkv pairs; here the view is as long as the largest
head's selection (see Storage). Decode reads are the paper's. Generated tokens are
appended without further eviction, as in SnapKV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsevllm.sparse.base import KVAccess, MethodSettings, SeqStep
from sparsevllm.sparse.snapkv import SnapKV, SnapKVKnobs
from sparsevllm.sparse.spec import SHARED_BUDGET, DecodeViews, MethodSpec, knob

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch


@dataclass(frozen=True)
class AdaKVKnobs(SnapKVKnobs):
    adakv_alpha_safeguard: float = knob(
        0.2,
        "Ada-KV: every KV head keeps at least this fraction of the per-head middle budget; "
        "the rest of the layer's budget goes to the best (head, token) pairs jointly.",
        minimum=0,
        maximum=1,
    )


@dataclass(frozen=True)
class HeadRows:
    """The rows of a compacted layer view each KV head reads (decode)."""

    rows: torch.Tensor  # [Hkv, W] int32 view rows, ascending per head (past counts: pad)
    counts: torch.Tensor  # [Hkv] int32 rows of each head
    width: int  # rows the compaction kept; every head reads the rows after it

    def positions(self, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head view positions `[Hkv, W + g]` (ascending; past a head's count:
        unspecified) and counts `[Hkv]` for a view of `context` entries before the new
        token: each head's own rows, then the g = context - width generated ones."""
        hkv, w = self.rows.shape
        generated = context - self.width
        col = torch.arange(w + generated, device=self.rows.device)  # [W + g]
        own = self.rows[:, col.clamp(max=w - 1)]  # [Hkv, W + g]
        after = self.width + col[None, :] - self.counts[:, None]  # [Hkv, W + g]
        mine = col[None, :] < self.counts[:, None]
        return torch.where(mine, own, after.to(own.dtype)), self.counts + generated


class AdaKV(SnapKV):
    name = "adakv"
    knobs: AdaKVKnobs
    decode_views = DecodeViews.EAGER
    model_heads = True  # one budget over every KV head of a layer
    # Its cut keeps per-head counts that decode reads through select_views; cutting
    # between chunks is not defined for it (yet).
    bounded_prefill = False

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self._rows: dict[int, dict[int, HeadRows]] = {}  # seq_id -> layer -> head rows

    def _worst_width(self, prompt_len: int) -> int:
        """The longest compacted view of a prompt of `prompt_len` tokens."""
        budget = self.config.decode_keep_tokens
        if prompt_len <= budget:
            return prompt_len
        sink, recent, middle = split_budget(
            budget, self.config.sink_keep_tokens, self.config.recent_keep_tokens
        )
        safe = safeguard(middle, self.knobs.adakv_alpha_safeguard)
        h = self.num_kv_heads
        return sink + recent + min(prompt_len - sink - recent, middle * h - (h - 1) * safe)

    def max_resident(self, prompt_len: int, max_tokens: int) -> int:
        return max(prompt_len, self.decode_resident(prompt_len, max_tokens))

    def decode_resident(self, prompt_len: int, max_tokens: int) -> int:
        return self._worst_width(prompt_len) + max_tokens

    def compress(self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None) -> None:
        scores = self.score(layer, step, kv, attn)  # [Hkv, L]
        c = self.config
        keep, read = adaptive_keep(
            scores,
            c.decode_keep_tokens,
            c.sink_keep_tokens,
            c.recent_keep_tokens,
            self.knobs.adakv_alpha_safeguard,
        )
        kv.keep_per_head(step.seq_id, layer, keep)
        self._rows.setdefault(step.seq_id, {})[layer] = head_rows(read)

    def select_views(
        self, layer: int, q: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        group = batch.group_of_layer[layer]
        picks: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batch.q_lens)
        for step in batch.sparse.own_steps(self):
            i = step.row
            rows = self._rows.get(step.seq_id, {}).get(layer)
            context = batch.view_lens[group][i] - 1  # the view minus the new token
            # A row asking for scores (a one-token prompt continuing the chain, as in the
            # throughput benchmark's second phase, inside SnapKV's window) reads every
            # kept row: a selected view cannot give scores.
            single = batch.q_lens[i] == 1 and not batch.sparse.wants_scores(layer, i)
            ok = rows is not None and single and context >= rows.width
            picks[i] = rows.positions(context) if ok and rows is not None else None
        if all(p is None for p in picks):
            return None
        width = max(p[0].shape[1] for p in picks if p is not None)
        subset = torch.zeros((len(picks), self.num_kv_heads, width), dtype=torch.int32)
        lens = torch.full((len(picks), self.num_kv_heads), -1, dtype=torch.int32)
        subset, lens = subset.to(q.device), lens.to(q.device)
        for i, p in enumerate(picks):
            if p is not None:
                subset[i, :, : p[0].shape[1]] = p[0]
                lens[i] = p[1]
        return subset, lens

    def on_compressed(self, seq_id: int, layer: int, keep: torch.Tensor) -> None:
        # Compacted by someone else (pruning): the rows no longer match; read them all.
        super().on_compressed(seq_id, layer, keep)
        self._rows.get(seq_id, {}).pop(layer, None)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._rows.pop(seq_id, None)

    def export_state(self, seq_id: int) -> dict[str, torch.Tensor]:
        """Each layer's head rows: without them a continued chain (restored from disk,
        or a copy) would read every kept row instead of each head's own."""
        out: dict[str, torch.Tensor] = {}
        for layer, rows in self._rows.get(seq_id, {}).items():
            out[f"{layer}.rows"] = rows.rows.cpu()  # [Hkv, W] int32
            out[f"{layer}.counts"] = rows.counts.cpu()  # [Hkv] int32
            out[f"{layer}.width"] = torch.tensor(rows.width)
        return out

    def import_state(
        self, seq_id: int, state: dict[str, torch.Tensor], device: torch.device
    ) -> None:
        layers = {int(key.split(".")[0]) for key in state}
        self._rows[seq_id] = {
            layer: HeadRows(
                state[f"{layer}.rows"].to(device),
                state[f"{layer}.counts"].to(device),
                int(state[f"{layer}.width"]),
            )
            for layer in layers
        }


def split_budget(budget: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(sink, recent, middle) of a per-head budget, as `select_keep` clamps them."""
    sink = min(sink, budget)
    recent = min(recent, budget - sink)
    return sink, recent, budget - sink - recent


def safeguard(middle: int, alpha: float) -> int:
    """Middle tokens every head keeps whatever the other heads score."""
    n = int(middle * alpha)
    return max(1, n) if alpha > 0 and middle > 0 else n


def joint_top(mid: torch.Tensor, per_head: int, safe: int) -> torch.Tensor:
    """`mid` `[Hkv, M]` scores -> `[Hkv, M]` bool: each head's `safe` best, then the best
    of all heads' pairs, `per_head x Hkv` pairs in all."""
    h, m = mid.shape
    pri = mid.float().clone()
    if safe > 0:
        pri.scatter_(1, mid.topk(safe, dim=-1).indices, float("inf"))
    chosen = torch.zeros(h * m, dtype=torch.bool, device=mid.device)
    chosen[pri.flatten().topk(per_head * h).indices] = True
    return chosen.view(h, m)


def adaptive_keep(
    scores: torch.Tensor, budget: int, sink: int, recent: int, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores` `[Hkv, L]` (higher kept) -> (keep `[Hkv, K]` ascending positions, read
    `[Hkv, K]` bool): the rows a compaction keeps (K = S + max_h n_h + R) and which of
    them each head reads (its S + n_h + R selected tokens; the others pad it)."""
    h, length = scores.shape
    dev = scores.device
    if budget >= length:
        keep = torch.arange(length, device=dev).expand(h, length)
        return keep, torch.ones(h, length, dtype=torch.bool, device=dev)
    sink, recent, middle = split_budget(budget, sink, recent)
    mid = scores[:, sink : length - recent]  # [Hkv, M]
    chosen = joint_top(mid, middle, safeguard(middle, alpha))  # [Hkv, M]
    width = int(chosen.sum(dim=1).max())
    # Each head's chosen tokens first, then its next best up to the widest head's count.
    pri = torch.where(chosen, float("inf"), mid.float())
    idx = pri.topk(width, dim=-1).indices.sort(dim=-1).values  # [Hkv, width]
    keep = torch.cat(
        [
            torch.arange(sink, device=dev).expand(h, sink),
            idx + sink,
            torch.arange(length - recent, length, device=dev).expand(h, recent),
        ],
        dim=-1,
    )
    read = torch.cat(
        [
            torch.ones(h, sink, dtype=torch.bool, device=dev),
            chosen.gather(1, idx),
            torch.ones(h, recent, dtype=torch.bool, device=dev),
        ],
        dim=-1,
    )
    return keep, read


def head_rows(read: torch.Tensor) -> HeadRows:
    """`read` `[Hkv, K]` bool over the compacted rows -> each head's rows and count."""
    h, k = read.shape
    counts = read.sum(dim=1).to(torch.int32)  # [Hkv]
    col = torch.arange(k, device=read.device).expand(h, k)
    # Read rows first (ascending), the others after them: a stable sort on "not read".
    order = (~read).to(torch.int8).sort(dim=1, stable=True).indices  # [Hkv, K]
    return HeadRows(col.gather(1, order).to(torch.int32), counts, k)


SPEC = MethodSpec(
    name="adakv",
    family="physical_eviction",
    description="at prefill end SnapKV's votes with the layer's budget allocated over its "
    "KV heads jointly (heads keep different counts; safeguard per head)",
    method=AdaKV,
    knobs=AdaKVKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
)
