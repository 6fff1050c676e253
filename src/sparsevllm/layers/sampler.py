"""Batched token sampler, run once per engine step on the last-position logits.

Pipeline per row: penalties -> min_tokens stop suppression -> structured-output token
mask -> (greedy: argmax) -> temperature -> top-k -> top-p -> min-p -> exponential-race
sampling.

Reproducibility: a row with its own ``torch.Generator`` draws exactly ``V``
exponential variates from that generator per step, in vocab order, independent
of the other rows. So the same seed and the same logits give the same token no
matter how the batch is composed. Rows without a generator share one vectorised
draw from the device's global RNG.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from sparsevllm.layers.cpu_argmax import argmax as cpu_argmax
from sparsevllm.sampling import SamplingParams
from sparsevllm.upload import upload

TokenHistory = tuple[Sequence[int], Sequence[int]]


@dataclass
class TokenLogprobs:
    """Logprob information for one generated token.

    All values come from ``log_softmax`` of the logits *after* repetition/presence/
    frequency penalties and min_tokens suppression, but *before* temperature,
    top-k, top-p and min-p. That is the model's (penalised) distribution: it is
    comparable across requests with different sampling knobs and the chosen
    token always has a finite logprob, even when temperature/truncation would
    reshape the distribution it was actually drawn from.
    """

    token_id: int
    logprob: float
    # Top-N (token_id, logprob) pairs, best first; empty when N == 0.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class TokenBitmask(NamedTuple):
    """The tokens some rows may sample (structured outputs): bit `t % 32` of word `t // 32`
    of `bits[j]` allows token t in batch row `rows[j]`; other rows are unconstrained."""

    rows: torch.Tensor  # [R] long
    bits: torch.Tensor  # [R, ceil(vocab / 32)] int32


@dataclass
class SamplerOutput:
    """Result of one sampler call: one token (and optional logprobs) per row."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """Create a per-request generator seeded with ``seed`` (``None`` -> no generator).

    The generator must live on the same device as the logits it samples from.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    # manual_seed only accepts values representable as uint64; wrap negatives.
    gen.manual_seed(seed % (1 << 64))
    return gen


class SampledTokens:
    """One sampler call's tokens, still on the device (`device_ids` `[S]`, which a next
    step can read as its input ids without a host round trip); `result()` brings them
    (and the logprobs) to the host, waiting only for the sampling itself."""

    def __init__(
        self, device_ids: torch.Tensor, logits: torch.Tensor, params: Sequence[SamplingParams]
    ) -> None:
        self.device_ids = device_ids
        self._logits, self._params = logits, params
        self._host: torch.Tensor | None = None
        self._event = None
        if device_ids.is_cuda:  # start the copy now; later work on the stream is not waited for
            self._host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
            self._host.copy_(device_ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SamplerOutput:
        if self._event is not None:
            self._event.synchronize()
            ids = self._host.tolist()
        else:
            ids = self.device_ids.tolist()
        logprobs = _gather_logprobs(self._logits, self._params, self.device_ids)
        return SamplerOutput(token_ids=ids, logprobs=logprobs)


class Sampler:
    """Stateless batched sampler; see the module docstring for the pipeline."""

    def __call__(self, *args: Any, **kwargs: Any) -> SamplerOutput:
        """`launch(...)` (same arguments), waiting for the tokens on the host."""
        return self.launch(*args, **kwargs).result()

    def launch(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_histories: Sequence[TokenHistory],
        generators: Sequence[torch.Generator | None],
        *,
        eos_token_ids: Collection[int] = frozenset(),
        token_bitmask: TokenBitmask | None = None,
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> SampledTokens:
        """Sample on the device without waiting for the result (see SampledTokens).
        `agree` makes the drawn tokens the same on every tensor-parallel rank (a broadcast
        from rank 0: rows without a seed draw from each process's own global RNG)."""
        batch = logits.shape[0]
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if not (len(params) == len(token_histories) == len(generators) == batch):
            raise ValueError(
                f"batch mismatch: logits {batch}, params {len(params)}, "
                f"histories {len(token_histories)}, generators {len(generators)}"
            )
        # Always copy: penalties and masking work in place and must not touch the caller's
        # tensor (``.float()`` would alias an fp32 input).
        logits = logits.to(dtype=torch.float32, copy=True)
        apply_penalties(logits, params, token_histories)
        suppress_stop_tokens(logits, params, token_histories, eos_token_ids)
        if token_bitmask is not None:
            apply_token_bitmask(logits, token_bitmask)

        # One argmax for every row is cheaper than splitting; sampled rows overwrite theirs.
        native = cpu_argmax(logits)  # None off the CPU
        token_ids = native if native is not None else logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = upload(sampled, torch.long, logits.device)
            token_ids[rows] = _sample_rows(
                logits[rows], [params[i] for i in sampled], [generators[i] for i in sampled]
            )
            if agree is not None:
                agree(token_ids)
        return SampledTokens(token_ids, logits, params)


def needs_history(p: SamplingParams) -> bool:
    """Whether sampling a row reads its token history or reports logprobs (a step whose
    input token is not on the host yet cannot serve it)."""
    return _needs_penalty(p) or p.logprobs is not None


# ---------------------------------------------------------------------- penalties
def _needs_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _flat_token_index(
    seqs: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """Indices into a flattened ``[len(seqs), vocab]`` tensor, one per token occurrence.

    Ids outside ``[0, vocab)`` are dropped: they would otherwise alias another row.
    """
    flat = [t + row * vocab for row, seq in enumerate(seqs) for t in seq if 0 <= t < vocab]
    return upload(flat, torch.long, device)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_histories: Sequence[TokenHistory],
) -> None:
    """Apply repetition, presence and frequency penalties to ``logits`` in place.

    ``repetition_penalty`` (HF/CTRL): for every token seen in prompt or output,
    positive logits are divided by it and negative ones multiplied.
    ``frequency_penalty``/``presence_penalty`` (OpenAI): subtract
    ``freq * count + presence * (count > 0)`` with counts over output tokens only.
    """
    rows = [i for i, p in enumerate(params) if _needs_penalty(p)]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    row_idx = upload(rows, torch.long, device)
    sub = logits[row_idx]
    n = len(rows)

    out_flat = _flat_token_index([token_histories[i][1] for i in rows], vocab, device)
    counts = torch.zeros(n * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, out_flat, torch.ones_like(out_flat, dtype=torch.float32))
    counts = counts.view(n, vocab)

    reps = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in reps):  # decided on the host: no device sync
        rep = upload(reps, torch.float32, device)
        seen = (counts > 0).view(-1)
        seen[_flat_token_index([token_histories[i][0] for i in rows], vocab, device)] = True
        seen = seen.view(n, vocab)
        rep = rep[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)

    freq = upload([params[i].frequency_penalty for i in rows], torch.float32, device)
    pres = upload([params[i].presence_penalty for i in rows], torch.float32, device)
    sub = sub - freq[:, None] * counts - pres[:, None] * (counts > 0).float()
    logits[row_idx] = sub


def suppress_stop_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_histories: Sequence[TokenHistory],
    eos_token_ids: Collection[int],
) -> None:
    """Mask EOS and ``stop_token_ids`` to ``-inf`` for rows still below ``min_tokens``.

    EOS is left alone for ``ignore_eos`` rows, because EOS does not end those
    requests anyway (matches vLLM's min_tokens processor).
    """
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for row, (p, (_, output)) in enumerate(zip(params, token_histories, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            banned.update(eos_token_ids)
        banned_in_vocab = [t for t in banned if 0 <= t < vocab]
        rows.extend([row] * len(banned_in_vocab))
        cols.extend(banned_in_vocab)
    if rows:
        device = logits.device
        logits[upload(rows, torch.long, device), upload(cols, torch.long, device)] = float("-inf")


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """Set (in place) the logits of the tokens `mask` forbids to ``-inf``; tokens past
    the mask's width are forbidden too (a logits row wider than the tokenizer)."""
    vocab = logits.shape[1]
    # Bytes of little-endian words: token t is bit t % 8 of byte t // 8. Unpacking bytes
    # keeps the intermediate at one byte per token (a shift per 32-bit word takes four).
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    unpacked = (mask.bits.view(torch.uint8).unsqueeze(-1) >> shifts).bitwise_and_(1)
    allowed = unpacked.view(torch.bool).flatten(1)[:, :vocab]
    if allowed.shape[1] < vocab:
        pad = allowed.new_zeros((allowed.shape[0], vocab - allowed.shape[1]))
        allowed = torch.cat([allowed, pad], dim=1)
    logits[mask.rows] = torch.where(allowed, logits[mask.rows], float("-inf"))


# ---------------------------------------------------------------------- sampling
def _sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Sample one token per row of (already penalised) non-greedy ``logits``."""
    device, vocab = logits.device, logits.shape[1]
    temps = upload([p.temperature for p in params], torch.float32, device)
    logits.div_(temps[:, None])

    if any(p.top_k_enabled or p.top_p < 1.0 for p in params):
        # Disabled knobs become no-op thresholds so the batch stays vectorised.
        top_k = upload(
            [min(p.top_k, vocab) if p.top_k_enabled else vocab for p in params], torch.long, device
        )
        top_p = upload(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], torch.float32, device
        )
        apply_top_k_top_p(logits, top_k, top_p)
    if any(p.min_p > 0.0 for p in params):
        apply_min_p(logits, upload([p.min_p for p in params], torch.float32, device))

    probs = logits.softmax(dim=-1)
    return _exponential_race(probs, generators)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask (in place) tokens outside top-k, then outside the top-p nucleus.

    ``top_k[i]`` is the number of tokens kept in row ``i`` (``vocab`` disables);
    the nucleus is the smallest prefix of the sorted, top-k-renormalised
    distribution whose mass reaches ``top_p[i]`` (``> 1`` disables). The most
    likely token is always kept.
    """
    vocab = logits.shape[1]
    # stable=True makes tie order depend only on the row itself, not the batch.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= top_k[:, None]
    sorted_logits.masked_fill_(remove, float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False

    mask = torch.empty_like(remove).scatter_(1, sorted_idx, remove)
    logits.masked_fill_(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask (in place) tokens whose probability is below ``min_p * max_prob``."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))


def _exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """Draw ``argmax(probs / E)`` with ``E ~ Exponential(1)``, i.e. a sample from ``probs``.

    Seeded rows draw their noise into a fresh ``[vocab]`` tensor so the stream a
    generator produces never depends on the shape of the surrounding batch.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    else:
        if unseeded:
            idx = upload(unseeded, torch.long, probs.device)
            noise[idx] = torch.empty_like(probs[idx]).exponential_()
        for i, gen in enumerate(generators):
            if gen is not None:
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=gen)
    # A zero draw would turn 0/0 into NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


# ---------------------------------------------------------------------- logprobs
def _gather_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens plus top-N alternatives (see ``TokenLogprobs``)."""
    result: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    row_idx = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[row_idx], dim=-1)
    chosen_ids = token_ids[row_idx]
    chosen = logp.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    # One topk at the largest N requested in the batch; rows slice their own N.
    k = min(max(params[i].logprobs or 0 for i in rows), logp.shape[1])
    top_vals, top_ids = logp.topk(k, dim=-1)
    top_vals_l, top_ids_l, chosen_l = top_vals.tolist(), top_ids.tolist(), chosen_ids.tolist()
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = list(zip(top_ids_l[j][:n], top_vals_l[j][:n], strict=True))
        result[i] = TokenLogprobs(chosen_l[j], chosen[j], top)
    return result
