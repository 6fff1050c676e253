"""Expected Attention (Devoto et al., 2025; NVIDIA kvpress `ExpectedAttentionPress`).

Query-agnostic eviction that models the queries still to come: the prompt's queries
(pre-RoPE) are summarised by their mean mu and covariance S per query head, moved to the
next N = `expected_attention_n_future` positions with the average RoPE rotation
A = mean_{t=P..P+N-1} R_t (P: the prompt length), and each key is scored by the
expected unnormalised attention of a Gaussian query q ~ N(A mu, A S A^T):

    z_j = (A mu) . k_j / sqrt(d) + k_j^T (A S A^T) k_j / (2 d)
    s_j = mean over the KV head's query heads of softmax_j(z_j)   (j past the sink)
    s_j = (s_j + epsilon) ||v_j||                                 (expected_attention_use_vnorm)

Sink tokens score above every other; each KV head keeps sink + recent + the highest s_j,
`decode_keep_tokens` in all, at the end of the prompt (`ScoreEviction`).

How it gets the queries: the method asks for the prompt's queries from position
max(sink, P - W) on (W = `expected_attention_window`, 0: every query past the sink, as
kvpress does) through `query_rows`; the backend hands each layer's post-RoPE queries
to `observe_queries`, which turns them back to pre-RoPE (R_p^-1, the model's
`rope_frequencies`) and folds them into running sums, so chunked prefill gives the
statistics of one full prefill. A YaRN-style attention factor on cos/sin cancels: the
post-RoPE queries carry it once, A in kvpress carries it once.

Differences from kvpress: the recent `recent_keep_tokens` are kept as well (kvpress keeps
only the sink); statistics come from the queries as attention sees them (qk-norm
applied, as kvpress's `get_prerope_query_states`), accumulated in float32; a chain's
next turn sees only that turn's queries (the history's were computed in earlier turns).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sparsevllm.kv.layout import MLA_LATENT
from sparsevllm.sparse.base import KVAccess, MethodSettings, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class ExpectedAttentionKnobs(MethodKnobs):
    expected_attention_n_future: int = knob(
        512, "Future positions the RoPE rotation of the query statistics averages over.", minimum=1
    )
    expected_attention_window: int = knob(
        0, "Newest prompt queries the statistics use (0: every query past the sink).", minimum=0
    )
    expected_attention_use_covariance: bool = knob(
        True, "Add the query covariance term to the expected logits."
    )
    expected_attention_use_vnorm: bool = knob(True, "Scale scores by the value norms.")
    expected_attention_epsilon: float = knob(
        0.0, "Added to the scores before the value-norm scaling.", minimum=0.0
    )


@dataclass
class QueryMoments:
    """Running sums of one layer's pre-RoPE queries: count, sum `[Hq, D]`, and (with
    covariance) the sum of outer products `[Hq, D, D]`.

    The outer sum costs D rows of queries: until `head_dim` queries have arrived they are
    kept as they are (`pending`) and folded in only then, so the statistics of a short
    window, or of the one recomputed token that ends a copied prompt, take a small
    fraction of it (one `[32, 128, 128]` float32 sum is 2 MiB per layer; hundreds of
    sequences finishing their prompts in one step would hold gigabytes)."""

    count: int
    total: torch.Tensor
    covariance: bool
    outer: torch.Tensor | None = None
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, Hq, D] each

    def add(self, q: torch.Tensor) -> None:
        """q: `[n, Hq, D]` float32 pre-RoPE queries."""
        self.count += q.shape[0]
        self.total += q.sum(dim=0)
        if not self.covariance:
            return
        self.pending.append(q)
        if self.outer is not None or sum(p.shape[0] for p in self.pending) >= q.shape[-1]:
            self._fold()

    def _fold(self) -> None:
        rows = torch.cat(self.pending)  # [n, Hq, D]
        self.pending = []
        outer = torch.einsum("nhi,nhj->hij", rows, rows)  # [Hq, D, D]
        self.outer = outer if self.outer is None else self.outer + outer

    @staticmethod
    def empty(
        num_heads: int, head_dim: int, covariance: bool, device: torch.device
    ) -> QueryMoments:
        return QueryMoments(0, torch.zeros((num_heads, head_dim), device=device), covariance)

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mu `[Hq, D]`, biased covariance `[Hq, D, D]` or None); zeros when empty."""
        n = max(self.count, 1)
        mu = self.total / n
        if not self.covariance:
            return mu, None
        if self.pending:
            self._fold()
        outer = self.outer if self.outer is not None else mu.new_zeros(mu.shape + mu.shape[-1:])
        return mu, outer / n - torch.einsum("hi,hj->hij", mu, mu)


class ExpectedAttention(ScoreEviction):
    name = "expected_attention"
    knobs: ExpectedAttentionKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        # (seq_id, layer) -> the prompt queries seen so far, until the prompt's end.
        self._moments: dict[tuple[int, int], QueryMoments] = {}

    def _first_query(self, step: SeqStep) -> int:
        """Logical position of the first prompt query the statistics use."""
        window = self.knobs.expected_attention_window
        first = step.prompt_len - window if window else 0
        return max(first, self.config.sink_keep_tokens)

    def prefill_query_rows(self, step: SeqStep) -> int:
        first = max(self._first_query(step), step.start)
        if first >= min(step.end, step.prompt_len):
            return 0
        return step.end - first  # the newest rows: from `first` to the step's end

    def observe_queries(self, layer: int, step: SeqStep, q: torch.Tensor, kv: KVAccess) -> None:
        start = step.end - q.shape[0]
        n = min(step.end, step.prompt_len) - start  # drop rows past the prompt (a recompute)
        positions = torch.arange(start, start + n, device=q.device)
        pre = unrotate(q[:n].float(), positions, _freqs(kv, layer, q.device))  # [n, Hq, D]
        key = (step.seq_id, layer)
        if key not in self._moments:
            use_cov = self.knobs.expected_attention_use_covariance
            self._moments[key] = QueryMoments.empty(pre.shape[1], pre.shape[2], use_cov, q.device)
        self._moments[key].add(pre)

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        k = self.knobs
        keys = kv.keys(step.seq_id, layer)  # [L, Hkv, D]
        moments = self._moments.pop((step.seq_id, layer), None)
        if moments is None:  # no query past the sink: every key expects the same logit
            moments = QueryMoments.empty(self.num_kv_heads, keys.shape[-1], False, keys.device)
        mu, cov = moments.mean_cov()
        freqs = _freqs(kv, layer, keys.device)
        mu, cov = future_statistics(mu, cov, freqs, step.prompt_len, k.expected_attention_n_future)
        values = kv.values(step.seq_id, layer) if k.expected_attention_use_vnorm else None
        sink = self.config.sink_keep_tokens
        return expected_attention_scores(keys, values, mu, cov, sink, k.expected_attention_epsilon)

    def should_compress(self, step: SeqStep, resident: int, layer: int) -> bool:
        if step.finishes_prompt and resident <= self.layer_budget(layer):
            self._moments.pop((step.seq_id, layer), None)  # nothing to evict: drop them
        return super().should_compress(step, resident, layer)

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._moments if key[0] == seq_id]:
            del self._moments[key]


def _freqs(kv: KVAccess, layer: int, device: torch.device) -> torch.Tensor | None:
    freqs = kv.rope_frequencies(layer)
    return None if freqs is None else freqs.to(device=device, dtype=torch.float32)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x `[..., D]` by angles with cos, sin `[..., D/2]` (broadcast)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def unrotate(q: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
    """Post-RoPE queries `[n, Hq, D]` at `positions` `[n]` -> pre-RoPE (pure rotation
    back: any attention factor on cos/sin stays, see the module docstring)."""
    if freqs is None:
        return q
    angles = positions.float()[:, None] * freqs[None, :]  # [n, D/2]
    return rotate(q, angles.cos()[:, None, :], -angles.sin()[:, None, :])


def future_statistics(
    mu: torch.Tensor, cov: torch.Tensor | None, freqs: torch.Tensor | None, start: int, n: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A mu `[Hq, D]`, A cov A^T `[Hq, D, D]`), A = mean of the RoPE rotations of
    positions start .. start + n - 1 (per pair: the mean cos and the mean sin)."""
    if freqs is None:
        return mu, cov
    angles = torch.arange(start, start + n, device=mu.device).float()[:, None] * freqs  # [n, D/2]
    cos, sin = angles.cos().mean(dim=0), angles.sin().mean(dim=0)  # [D/2]
    mu = rotate(mu, cos, sin)
    if cov is not None:
        # rotate() maps each row x to A x, i.e. X -> X A^T; twice (with a transpose
        # between) gives A cov A^T because cov is symmetric.
        cov = rotate(rotate(cov, cos, sin).transpose(-1, -2), cos, sin)
    return mu, cov


def expected_attention_scores(
    keys: torch.Tensor,
    values: torch.Tensor | None,
    mu: torch.Tensor,
    cov: torch.Tensor | None,
    sink: int,
    epsilon: float,
) -> torch.Tensor:
    """Keys `[L, Hkv, D]` (values likewise or None), future query mean `[Hq, D]` and
    covariance `[Hq, D, D]` -> `[Hkv, L]` scores; the first `sink` keys score highest."""
    length, hkv, d = keys.shape
    hq = mu.shape[0]
    k = keys[sink:].float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)  # [Hq, M, D]
    logits = torch.einsum("hmd,hd->hm", k, mu) / math.sqrt(d)  # [Hq, M]
    if cov is not None:
        logits = logits + torch.einsum("hmi,hij,hmj->hm", k, cov, k) / (2 * d)
    probs = logits.softmax(dim=-1).view(hkv, hq // hkv, -1).mean(dim=1)  # [Hkv, M]
    if values is not None:
        probs = (probs + epsilon) * values[sink:].float().norm(dim=-1).t()
    top = probs.max() + 1 if probs.numel() else probs.new_ones(())
    return torch.cat([top.expand(hkv, min(sink, length)), probs], dim=-1)  # [Hkv, L]


SPEC = MethodSpec(
    name="expected_attention",
    family="physical_eviction",
    description="at prefill end keep sink + recent + the keys with the highest expected "
    "attention of future queries (prompt query mean and covariance moved by the average "
    "RoPE of the next positions), scaled by value norms, per KV head",
    method=ExpectedAttention,
    knobs=ExpectedAttentionKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    refused_layouts={
        MLA_LATENT: "it models the per-head RoPE queries that meet the keys, and an MLA "
        "cache holds latent rows met by absorbed queries"
    },
)
