"""Behaviour of the batched Sampler against plain-Python references."""

from __future__ import annotations

import math
from collections import Counter

# Make `src/` importable when the package is not installed (plain `python -m pytest`).
import pytest
import torch

from sparsevllm.layers.sampler import (
    Sampler,
    SamplerOutput,
    TokenBitmask,
    TokenLogprobs,
    apply_penalties,
    make_generator,
)
from sparsevllm.sampling import SamplingParams

sampler = Sampler()
# The token mask runs where the logits are: on CUDA too when the machine has it.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: set[int] | None = None,
) -> SamplerOutput:
    """Call the sampler with empty histories / no generators unless given."""
    b = logits.shape[0]
    return sampler(
        logits,
        params,
        histories if histories is not None else [([], [])] * b,
        generators if generators is not None else [None] * b,
        eos_token_ids=eos or set(),
    )


def draw_many(row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """Sample ``n`` tokens from one logits row in a single vectorised call."""
    torch.manual_seed(seed)
    return run(row.expand(n, -1).clone(), [params] * n).token_ids


# ---------------------------------------------------------------------- greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 100).to(dtype)
    out = run(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    gens = [make_generator(i, "cpu") for i in range(8)]
    top1 = run(logits, [SamplingParams(temperature=1.0, top_k=1)] * 8, generators=gens)
    greedy = run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert top1.token_ids == greedy.token_ids == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.7, top_p=0.9),
    ]
    out = run(logits, params)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert all(0 <= t < 50 for t in out.token_ids)


def test_input_logits_not_modified() -> None:
    logits = torch.randn(2, 30)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, top_p=0.5, min_tokens=2),
        SamplingParams(temperature=0.3, top_k=3, min_p=0.2),
    ]
    run(logits, params, histories=[([1, 2], [3]), ([], [4])], eos={0})
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------- seeds
def seeded_tokens(seed: int, steps: list[torch.Tensor], params: SamplingParams) -> list[int]:
    gen = make_generator(seed, "cpu")
    return [run(row[None], [params], generators=[gen]).token_ids[0] for row in steps]


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    gen = make_generator(123, torch.device("cpu"))
    assert isinstance(gen, torch.Generator) and gen.initial_seed() == 123
    assert make_generator(-1, "cpu") is not None


def test_same_seed_same_samples_different_seed_different() -> None:
    torch.manual_seed(3)
    steps = [torch.randn(200) * 0.1 for _ in range(30)]  # near-uniform: many choices
    params = SamplingParams(temperature=1.0)
    a = seeded_tokens(42, steps, params)
    torch.manual_seed(999)  # the global RNG must not influence seeded rows
    assert seeded_tokens(42, steps, params) == a
    assert seeded_tokens(43, steps, params) != a
    firsts = {seeded_tokens(s, steps[:1], params)[0] for s in range(100)}
    assert len(firsts) > 40  # ~ 200 * (1 - e^{-0.5}) distinct expected


def test_seeded_row_independent_of_batch_composition() -> None:
    torch.manual_seed(4)
    vocab, n_steps = 300, 12
    target = [torch.randn(vocab) for _ in range(n_steps)]
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01)
    alone = seeded_tokens(7, target, params)

    gen = make_generator(7, "cpu")
    others = [make_generator(100, "cpu"), None, None]
    other_params = [
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, repetition_penalty=1.2),
    ]
    batched = []
    for row in target:
        logits = torch.randn(4, vocab)
        logits[2] = row
        out = run(
            logits,
            [other_params[0], other_params[1], params, other_params[2]],
            histories=[([1], [2]), ([], []), ([], []), ([3], [4, 5])],
            generators=[others[0], others[1], gen, others[2]],
        )
        batched.append(out.token_ids[2])
    assert batched == alone


# ---------------------------------------------------------------------- truncation
def reference_probs(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> dict[int, float]:
    """Allowed tokens and their renormalised probabilities, computed by sorting in Python."""
    z = [x / temperature for x in row.tolist()]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:top_k] if top_k > 0 else order
    m = z[kept[0]]
    weights = {i: math.exp(z[i] - m) for i in kept}
    total = sum(weights.values())
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += weights[i] / total
    pmax = weights[nucleus[0]]
    allowed = [i for i in nucleus if weights[i] >= min_p * pmax]
    norm = sum(weights[i] for i in allowed)
    return {i: weights[i] / norm for i in allowed}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 5, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.0, -1, 1.0, 0.3),
        (0.7, 8, 0.8, 0.0),
        (1.5, 10, 0.9, 0.1),
        (1.0, 1000, 0.5, 0.0),  # top_k larger than the vocabulary
    ],
)
def test_truncation_never_samples_outside_allowed_set(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    torch.manual_seed(5)
    row = torch.randn(32) * 1.5
    ref = reference_probs(row, temperature, top_k, top_p, min_p)
    assert 1 < len(ref) < 32  # the knob really truncates, yet leaves a choice
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    n = 20000
    counts = Counter(draw_many(row, params, n))
    assert set(counts) <= set(ref), set(counts) - set(ref)
    # The kept tokens are drawn with their renormalised probabilities.
    for tok, p in ref.items():
        assert abs(counts[tok] / n - p) < 0.02, (tok, counts[tok] / n, p)


def test_seeded_truncated_sampling_stays_in_allowed_set() -> None:
    torch.manual_seed(6)
    row = torch.randn(64)
    ref = reference_probs(row, 1.0, 10, 0.7, 0.05)
    params = SamplingParams(top_k=10, top_p=0.7, min_p=0.05)
    for seed in range(200):
        gen = make_generator(seed, "cpu")
        assert run(row[None], [params], generators=[gen]).token_ids[0] in ref


def test_unrestricted_sampling_matches_softmax() -> None:
    torch.manual_seed(7)
    row = torch.randn(10)
    probs = torch.softmax(row / 0.9, -1).tolist()
    n = 30000
    counts = Counter(draw_many(row, SamplingParams(temperature=0.9), n))
    for tok, p in enumerate(probs):
        assert abs(counts[tok] / n - p) < 0.015


# ---------------------------------------------------------------------- penalties
def reference_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


PENALTY_CASES = [
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=0.8),
    SamplingParams(frequency_penalty=0.5),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    SamplingParams(),  # untouched row in the same batch
]


def test_penalties_match_python_reference() -> None:
    torch.manual_seed(8)
    vocab = 8
    logits = torch.randn(len(PENALTY_CASES), vocab)
    histories = [
        ([0, 1, 1], [2, 2, 2, 3]),
        ([4], [5, 4]),
        ([6, 7], [1, 1, 0]),
        ([], [3, 3, 3, 7]),
        ([2], [2, 5, 5]),
        ([0, 6], [6, 6, 1, 99]),  # 99 is outside the vocab and must be ignored
        ([1, 2], [3, 4]),
    ]
    expected = [
        reference_penalties(logits[i].tolist(), h[0], [t for t in h[1] if t < vocab], p)
        for i, (p, h) in enumerate(zip(PENALTY_CASES, histories, strict=True))
    ]
    got = logits.clone()
    apply_penalties(got, PENALTY_CASES, histories)
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6)
    assert torch.equal(got[-1], logits[-1])


def test_penalties_feed_greedy_and_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4)
    out = run(logits, [p], histories=[([0], [])])
    # 3.0 / 2 = 1.5 < 2.9, so the penalty flips the argmax.
    assert out.token_ids == [1]
    ref = torch.log_softmax(torch.tensor([1.5, 2.9, -1.0, 0.5]), -1)
    lp = out.logprobs[0]
    assert lp is not None and lp.token_id == 1
    assert lp.logprob == pytest.approx(float(ref[1]), abs=1e-6)
    assert [t for t, _ in lp.top_logprobs] == [1, 0, 3, 2]


# ---------------------------------------------------------------------- logprobs
def test_logprobs_match_log_softmax_before_temperature() -> None:
    torch.manual_seed(9)
    logits = torch.randn(4, 40)
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(logprobs=None),
        SamplingParams(top_p=0.3, logprobs=20),
    ]
    gens = [make_generator(i, "cpu") for i in range(4)]
    out = run(logits, params, generators=gens)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            continue
        assert isinstance(lp, TokenLogprobs) and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-5)
        top_vals, top_ids = ref[i].topk(p.logprobs)
        assert [t for t, _ in lp.top_logprobs] == top_ids.tolist()
        assert [v for _, v in lp.top_logprobs] == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert out.logprobs[1] is not None and out.logprobs[1].top_logprobs == []


# ---------------------------------------------------------------------- min_tokens
def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)  # EOS (1) then stop id (2) lead
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], logprobs=0)
    out = run(logits, [p] * 3, histories=[([], [0, 0]), ([], [0, 0, 0]), ([1], [])], eos={1})
    assert out.token_ids == [3, 1, 3]
    assert out.logprobs[0] is not None and math.isfinite(out.logprobs[0].logprob)


def test_min_tokens_respects_ignore_eos() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[2])
    # EOS does not end ignore_eos requests, so only the stop token id is masked.
    assert run(logits, [p], eos={1}).token_ids == [1]
    p = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    logits = torch.tensor([[0.0, 4.0, 5.0, 1.0]])
    assert run(logits, [p], eos={1}).token_ids == [2]


def test_min_tokens_suppresses_eos_when_sampling() -> None:
    row = torch.full((5,), 2.0)  # uniform: every token is likely
    p = SamplingParams(min_tokens=1)
    assert set(draw_many(row, p, 5000)) == {0, 1, 2, 3, 4}
    n = 5000
    torch.manual_seed(0)
    out = sampler(
        row.expand(n, -1).clone(), [p] * n, [([], [])] * n, [None] * n, eos_token_ids={0, 4}
    )
    assert set(out.token_ids) == {1, 2, 3}


def test_batch_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="batch mismatch"):
        sampler(torch.zeros(2, 4), [SamplingParams()], [([], [])], [None])


# ---------------------------------------------------------------------- token bitmask
def _bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """The packed int32 bitmask (bit t % 32 of word t // 32) of each row's allowed set."""
    words = [[0] * ((vocab + 31) // 32) for _ in allowed]
    for row, tokens in zip(words, allowed):
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
    # Bit 31 makes a word negative as an int32.
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in r] for r in words])


@pytest.mark.parametrize("device", DEVICES)
def test_token_bitmask_restricts_only_its_rows(device: str) -> None:
    vocab = 100  # not a multiple of 32: the last word is partly past the vocabulary
    allowed = [{3, 31, 63, 99}, {0, 64}]
    bits = _bitmask(allowed, vocab).to(torch.int32).to(device)
    mask = TokenBitmask(torch.tensor([0, 2], device=device), bits)
    torch.manual_seed(0)
    rows = 3
    params = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.0)]
    seen: list[set[int]] = [set() for _ in range(rows)]
    for _ in range(200):
        logits = torch.randn(rows, vocab, device=device) * 5
        out = sampler(logits, params, [([], [])] * rows, [None] * rows, token_bitmask=mask)
        for row, token in enumerate(out.token_ids):
            seen[row].add(token)
    assert seen[0] == allowed[0]  # every allowed token drawn, nothing else
    assert seen[2] <= allowed[1] and len(seen[2]) == 2  # greedy: the best allowed one
    assert len(seen[1]) > 50  # an unmasked row samples the whole vocabulary


def test_token_bitmask_forbids_logits_past_its_width() -> None:
    logits = torch.zeros(1, 40)
    logits[0, 35] = 10.0  # the best token, but past a one-word (32-token) mask
    mask = TokenBitmask(torch.tensor([0]), _bitmask([{5}], 32).to(torch.int32))
    out = sampler(logits, [SamplingParams(temperature=0.0)], [([], [])], [None], token_bitmask=mask)
    assert out.token_ids == [5]
