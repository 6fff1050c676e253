"""Expected Attention against a plain reference of kvpress's definition (float64).

Reference (kvpress `ExpectedAttentionPress`), per layer at the end of a P-token prompt:
mu and the biased covariance S of the pre-RoPE queries past the sink, per query head;
R_t = s (cos(t f) I + sin(t f) P) (rotate-half RoPE as a matrix, s an attention factor),
Rbar = mean over t = P .. P + N - 1; mu' = Rbar mu, S' = Rbar S Rbar^T; per key past the
sink z = mu'.k / sqrt(d) + k^T S' k / (2d), softmax over keys, mean over the KV head's
query heads, times ||v||. The engine hands the method post-RoPE queries (scaled by s) in
chunks; the method must arrive at the same scores and keep sets.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eviction_harness import by_score, make_method, ref_keep
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction

HQ, HKV, D, LAYERS = 4, 2, 8, 2
SCALE = 1.25  # a YaRN-style attention factor on cos/sin: must cancel


def freqs() -> torch.Tensor:
    return 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rope_matrix(t: int) -> torch.Tensor:
    """R_t `[D, D]`: x -> s (x cos + rotate_half(x) sin)."""
    ang = t * freqs()
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    p = torch.zeros(D, D, dtype=torch.float64)
    h = D // 2
    p[h:, :h], p[:h, h:] = torch.eye(h), -torch.eye(h)
    return SCALE * (torch.diag(cos) + torch.diag(sin) @ p)


def ref_scores(q_pre, keys, values, sink, n_future, prompt_len) -> torch.Tensor:
    """kvpress's scores `[Hkv, L]` of one layer (sink tokens: max + 1)."""
    q = q_pre[sink:prompt_len]  # [N, Hq, D]
    mu = q.mean(dim=0)
    cen = q - mu
    cov = torch.einsum("nhi,nhj->hij", cen, cen) / q.shape[0]
    rbar = sum(rope_matrix(t) for t in range(prompt_len, prompt_len + n_future)) / n_future
    mu, cov = mu @ rbar.T, rbar @ cov @ rbar.T
    k = keys[sink:].transpose(0, 1).repeat_interleave(HQ // HKV, dim=0)  # [Hq, M, D]
    z = torch.einsum("hmd,hd->hm", k, mu) / math.sqrt(D)
    z = z + torch.einsum("hmi,hij,hmj->hm", k, cov, k) / D / 2
    s = z.softmax(dim=-1).view(HKV, HQ // HKV, -1).mean(dim=1)
    s = s * values[sink:].norm(dim=-1).t()
    return torch.cat([torch.full((HKV, sink), float(s.max()) + 1), s], dim=-1)


def post_rope(q_pre: torch.Tensor) -> torch.Tensor:
    return torch.stack([q_pre[t] @ rope_matrix(t).T for t in range(q_pre.shape[0])])


def run(method: ScoreEviction, q, keys, values, chunks, prompt_len):
    """Drive one sequence: per chunk store K/V, hand each layer the newest queries the
    method asks for (as a backend does), then after_step. Returns the kept positions."""
    total = sum(chunks)
    pool = KVPool(total + 8, LAYERS, method.layer_groups())
    kc = [torch.zeros(total + 8, HKV, D, dtype=torch.float64) for _ in range(LAYERS)]
    vc = [torch.zeros_like(c) for c in kc]
    rope = freqs().float()
    kv = RunnerKV(pool, [DenseStorage.wrap(k, v) for k, v in zip(kc, vc)], rope=lambda la: rope)
    start = 0
    for n in chunks:
        step = SeqStep(0, 0, start, n, prompt_len)
        new = pool.append(0, n)
        rows = method.query_rows(step)
        for layer in range(LAYERS):
            slots = torch.tensor(new[pool.group_of_layer[layer]])
            kc[layer][slots] = keys[layer][start : start + n]
            vc[layer][slots] = values[layer][start : start + n]
            if rows:
                method.observe_queries(layer, step, q[layer][start + n - rows : start + n], kv)
        method.after_step([step], {}, kv)
        start += n
    return [kv.logical_positions(0, pool.group_of_layer[la]).long() for la in range(LAYERS)]


def random_layers(seed: int, length: int):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q_pre = [rnd(length, HQ, D) + rnd(HQ, D) for _ in range(LAYERS)]
    keys = [rnd(length, HKV, D) for _ in range(LAYERS)]
    values = [rnd(length, HKV, D) for _ in range(LAYERS)]
    return q_pre, keys, values


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "length, budget, sink, recent, chunks",
    [(40, 12, 4, 4, [40]), (50, 16, 2, 4, [30, 20]), (33, 20, 4, 8, [7] * 4 + [5])],
)
def test_expected_attention_matches_kvpress_definition(seed, length, budget, sink, recent, chunks):
    q_pre, keys, values = random_layers(seed, length)
    knobs = dict(decode_keep_tokens=budget, sink_keep_tokens=sink, recent_keep_tokens=recent)
    m = make_method("expected_attention", LAYERS, HKV, expected_attention_n_future=32, **knobs)
    kept = run(m, [post_rope(q) for q in q_pre], keys, values, chunks, length)
    for layer in range(LAYERS):
        ref = ref_scores(q_pre[layer], keys[layer], values[layer], sink, 32, length)
        for h in range(HKV):
            want = ref_keep(by_score(ref[h].tolist()), length, budget, sink, recent)
            assert kept[layer][h].tolist() == want, (layer, h)


def test_scores_equal_the_reference_and_chunking_changes_nothing():
    from sparsevllm.sparse.expected_attention import (
        QueryMoments,
        expected_attention_scores,
        future_statistics,
        unrotate,
    )

    q_pre, keys, values = random_layers(7, 30)
    q = post_rope(q_pre[0]).float()
    f = freqs().float()
    moments = QueryMoments.empty(HQ, D, True, torch.device("cpu"))
    for a, b in [(4, 11), (11, 30)]:  # two chunks past a 4-token sink
        moments.add(unrotate(q[a:b], torch.arange(a, b), f))
    mu, cov = future_statistics(*moments.mean_cov(), f, 30, 16)
    got = expected_attention_scores(keys[0].float(), values[0].float(), mu, cov, 4, 0.0)
    ref = ref_scores(q_pre[0], keys[0], values[0], 4, 16, 30)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)


def test_window_uses_only_the_newest_prompt_queries():
    m = make_method("expected_attention", 1, HKV, expected_attention_window=8)
    assert m.query_rows(SeqStep(0, 0, 0, 20, 40)) == 0  # all before the window
    assert m.query_rows(SeqStep(0, 0, 20, 20, 40)) == 8
    assert m.query_rows(SeqStep(0, 0, 40, 1, 40)) == 0  # a decode row asks nothing
    whole = make_method("expected_attention", 1, HKV)  # window 0: every query past the sink
    assert whole.query_rows(SeqStep(0, 0, 0, 40, 40)) == 36


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6), st.integers(0, 2**16))
def test_moments_of_any_chunking_equal_one_pass(chunks, seed):
    """Rows are kept until head_dim have arrived, then folded: the statistics of any
    chunking equal those of all rows at once, and fewer than head_dim rows never build
    the [Hq, D, D] sum (the prompt-ending token of hundreds of copied sequences)."""
    from sparsevllm.sparse.expected_attention import QueryMoments

    rows = torch.randn(sum(chunks), HQ, D, generator=torch.Generator().manual_seed(seed))
    moments = QueryMoments.empty(HQ, D, True, torch.device("cpu"))
    start = 0
    for n in chunks:
        moments.add(rows[start : start + n])
        start += n
        assert (moments.outer is None) == (start < D)
    mu, cov = moments.mean_cov()
    want = rows.double()
    want_mu = want.mean(dim=0)
    centred = want - want_mu
    want_cov = torch.einsum("nhi,nhj->hij", centred, centred) / want.shape[0]
    torch.testing.assert_close(mu.double(), want_mu, rtol=1e-5, atol=1e-5)
    assert cov is not None
    torch.testing.assert_close(cov.double(), want_cov, rtol=1e-4, atol=1e-4)
