"""KVzip (Kim et al., 2025): score each KV entry by the attention it receives while the
model reconstructs the context.

"KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv
2505.23416). After the prompt is prefilled, the model reads a repeat instruction
followed by the context again, attending to the cached context; each cached entry
(layer, KV head, token) is scored by the largest attention probability any
reconstruction query of the KV head's query heads gives it. Entries that the model
needs to reproduce its input are the ones any later question can need, so the
selection does not depend on a question.

The reconstruction is a scoring pass (`SparseMethod.scoring_inputs`, run by the engine
after the forward that ends the prompt; its K/V are temporary): the span this prefill
computed, [f, P) (f = 0 for a fresh prompt, the cached history's length when a chain
continues), is cut into chunks of C = `kvzip_chunk_size` tokens (0: the engine's
`chunk_prefill_size`). Chunk 0 runs `kvzip_repeat_prompt` + its tokens, chunk c > 0
`kvzip_continue_prompt` + the previous chunk's last `kvzip_overlap_tokens` tokens + its
tokens, each its own forward over the whole resident view (the reference code's
prompts and chunking). As in the reference, chunk c's queries score only the anchor
(the sink, and in a chain the history a previous turn kept, scored by every chunk) and
the entries of their own segment: probabilities are normalised over anchor + segment +
the chunk's own keys (causal), so a chunk costs O(n x (anchor + n)) beyond its forward,
not O(n x L). Each layer then keeps, per KV head, sink + recent + the best-scored
middle, `decode_keep_tokens` in all (ScoreEviction); entries past the prompt (outputs
recomputed in the same chunk after a preemption) are always kept.

Differences from the reference: no chat template around the repeat prompt (the
prompts are knobs; the engine is chat-free); probabilities in float32 with the model's
own attention scale; the uniform per-head budget (the reference's `pair-uniform`
level), with the engine's sink and recent windows kept as by every eviction method;
the reference's default non-uniform level (one threshold over all layers and heads)
is not offered. A chain's later turn reconstructs only its own new tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, ScoringInput, SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob

# Reconstruction queries scored at once (bounds the float32 probabilities to
# Hq x block x (anchor + segment + chunk) elements).
_QUERY_BLOCK = 256


@dataclass(frozen=True)
class KVzipKnobs(MethodKnobs):
    kvzip_chunk_size: int = knob(
        0,
        "KVzip: context tokens per reconstruction forward (0: chunk_prefill_size).",
        minimum=0,
    )
    kvzip_repeat_prompt: str = knob(
        "\n\nRepeat the previous context exactly.\n\n",
        "KVzip: the instruction before the first reconstructed chunk.",
    )
    kvzip_continue_prompt: str = knob(
        "\n\nRepeat the part of the previous context exactly, starting with ",
        "KVzip: the instruction before each later chunk (then the previous chunk's "
        "last kvzip_overlap_tokens tokens and the chunk).",
    )
    kvzip_overlap_tokens: int = knob(
        8, "KVzip: tokens of the previous chunk repeated before a later chunk.", minimum=0
    )


@dataclass
class _Pass:
    """One sequence's reconstruction: where it starts, its chunks, and the scores."""

    first: int  # the first logical position this prefill computed
    end: int  # the step's end: view entry j of a layer holds position j - (L - end)
    segments: list[tuple[int, int]]  # logical [a, b) each scoring input reconstructs
    scores: dict[int, torch.Tensor]  # layer -> [Hkv, L] max probability so far


class KVzip(ScoreEviction):
    name = "kvzip"
    knobs: KVzipKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self._first: dict[int, int] = {}  # seq_id -> first prompt position prefilled
        self._passes: dict[int, _Pass] = {}

    @property
    def chunk_size(self) -> int:
        return self.knobs.kvzip_chunk_size or self.config.chunk_prefill_size

    def scoring_slots(self) -> int:
        k = self.knobs
        # A text has at most one token per UTF-8 byte (+ a word-start marker).
        text = max(len(k.kvzip_repeat_prompt.encode()), len(k.kvzip_continue_prompt.encode()))
        return text + 2 + k.kvzip_overlap_tokens + self.chunk_size

    def scoring_inputs(self, step: SeqStep, kv: KVAccess) -> list[ScoringInput]:
        seq = step.seq_id
        resident = {layer: kv.resident(seq, layer) for layer in self.layers}
        if not self.evicts(resident):
            return []  # nothing will be evicted: no pass
        first = self._first.get(seq, step.start)
        size, k = self.chunk_size, self.knobs
        segments = [
            (a, min(a + size, step.prompt_len)) for a in range(first, step.prompt_len, size)
        ]
        inputs = []
        for c, (a, b) in enumerate(segments):
            if c == 0:
                inputs.append(ScoringInput((k.kvzip_repeat_prompt, (a, b))))
            else:
                tail = max(first, a - k.kvzip_overlap_tokens)
                inputs.append(ScoringInput((k.kvzip_continue_prompt, (tail, b))))
        dev = kv.device
        scores = {
            layer: torch.zeros(self.num_kv_heads, n, dtype=torch.float32, device=dev)
            for layer, n in resident.items()
        }
        self._passes[seq] = _Pass(first, step.end, segments, scores)
        return inputs

    def evicts(self, resident: dict[int, int]) -> bool:
        """Whether a layer holding these counts will be cut (else no pass runs)."""
        return any(n > self.layer_budget(layer) for layer, n in resident.items())

    def observe_scoring(
        self,
        layer: int,
        step: SeqStep,
        index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float,
        kv: KVAccess,
    ) -> None:
        p = self._passes[step.seq_id]
        acc = p.scores[layer]  # [Hkv, L]
        length = acc.shape[1]
        offset = length - p.end  # view entry of logical position x: offset + x
        a, b = p.segments[index]
        anchor = min(length, max(offset + p.first, self.config.sink_keep_tokens))
        seg_start, seg_end = max(anchor, offset + a), offset + b
        ctx = [kv.keys(step.seq_id, layer, 0, anchor)]
        if seg_end > seg_start:
            ctx.append(kv.keys(step.seq_id, layer, seg_start, seg_end))
        keys = torch.cat(ctx)  # [m, Hkv, D]: anchor + segment
        got = reconstruction_scores(q, keys, k, scale)  # [Hkv, m]
        acc[:, :anchor] = torch.maximum(acc[:, :anchor], got[:, :anchor])
        if seg_end > seg_start:
            seg = acc[:, seg_start:seg_end]
            acc[:, seg_start:seg_end] = torch.maximum(seg, got[:, anchor:])

    def score(
        self, layer: int, step: SeqStep, kv: KVAccess, attn: torch.Tensor | None
    ) -> torch.Tensor:
        p = self._passes.get(step.seq_id)
        length = kv.resident(step.seq_id, layer)
        if p is None:  # nothing to reconstruct (an empty span): the newest tokens win
            return torch.arange(length, dtype=torch.float32, device=kv.device).expand(
                self.num_kv_heads, length
            )
        out = p.scores[layer].clone()
        out[:, length - (p.end - step.prompt_len) :] = float("inf")  # outputs: kept
        return out

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            if not step.is_decode:
                self._first.setdefault(step.seq_id, step.start)
        super().after_step(steps, scores, kv)
        for step in steps:
            if step.finishes_prompt:
                self._first.pop(step.seq_id, None)
                self._passes.pop(step.seq_id, None)

    def release(self, seq_id: int) -> None:
        self._first.pop(seq_id, None)
        self._passes.pop(seq_id, None)


def reconstruction_scores(
    q: torch.Tensor, context: torch.Tensor, own: torch.Tensor, scale: float
) -> torch.Tensor:
    """KVzip's score of `context` entries from one reconstruction chunk.

    q `[n, Hq, D]` (the chunk's queries), context `[m, Hkv, D]` (the cached keys they
    score), own `[n, Hkv, D]` (the chunk's keys, seen causally). Softmax over context +
    own per query head and query, in float32; returns the max over the KV head's query
    heads and over the queries, `[Hkv, m]`.
    """
    n, hq, d = q.shape
    m, hkv = context.shape[0], context.shape[1]
    keys = torch.cat([context.float(), own.float()]).permute(1, 2, 0)[:, None]  # [Hkv, 1, D, m+n]
    qg = q.float().view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    best = torch.zeros(hkv, m, dtype=torch.float32, device=q.device)
    cols = torch.arange(n, device=q.device)
    for lo in range(0, n, _QUERY_BLOCK):
        hi = min(n, lo + _QUERY_BLOCK)
        logits = (qg[:, :, lo:hi] @ keys) * scale  # [Hkv, G, r, m + n]
        future = cols[None, :] > torch.arange(lo, hi, device=q.device)[:, None]  # [r, n]
        logits[..., m:] = logits[..., m:].masked_fill(future, float("-inf"))
        probs = logits.softmax(dim=-1)[..., :m]  # [Hkv, G, r, m]
        best = torch.maximum(best, probs.amax(dim=(1, 2)))
    return best


def prune_scores(keys: torch.Tensor, positions: torch.Tensor, knobs: MethodKnobs) -> torch.Tensor:
    """KVzip's rule over a cached history, which keeps keys but neither queries nor the
    model's pass: every entry's key stands in for its query re-reading the history (a
    token's key and query come from the same hidden state), so each entry scores the max
    softmax probability it gets from any entry at or after its logical position, per KV
    head, with 1/sqrt(D). keys `[L, Hkv, D]`, positions `[Hkv, L]` -> `[Hkv, L]`."""
    k = keys.float().transpose(0, 1)  # [Hkv, L, D]
    length = k.shape[1]
    best = torch.zeros(k.shape[0], length, dtype=torch.float32, device=keys.device)
    for lo in range(0, length, _QUERY_BLOCK):
        hi = min(length, lo + _QUERY_BLOCK)
        logits = k[:, lo:hi] @ k.transpose(1, 2) / math.sqrt(k.shape[-1])  # [Hkv, r, L]
        future = positions[:, None, :] > positions[:, lo:hi, None]  # [Hkv, r, L]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)
        best = torch.maximum(best, probs.amax(dim=1))
    return best


SPEC = MethodSpec(
    name="kvzip",
    family="physical_eviction",
    description="at prefill end the model reconstructs the context in a chunked scoring "
    "pass; per KV head keep sink + recent + the entries its queries attend to most",
    method=KVzip,
    knobs=KVzipKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
    prune_scorer=prune_scores,
)
