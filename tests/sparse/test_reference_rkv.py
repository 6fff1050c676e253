"""R-KV against a plain reference of its definition (float64, Python loops).

The reference simulates the whole sequence itself: per KV head it holds a list of
logical tokens; every step appends its tokens and records, per held token, the
attention its last min(n, W) queries pay (softmax over the held keys, summed over the
queries, averaged over the KV head's query heads). Whenever a layer holds more than
B + I tokens (or more than B at the prompt's end) each head keeps sink + recent + the
best of s_j = lambda I_j - (1 - lambda) R_j: I_j is the window's attention to j (steps
ending in the last W positions) over its sum, R_j the softmax over held tokens of j's
mean cosine with the other held keys. The method runs on the real KV storage.
"""

from __future__ import annotations

import math

import pytest
import torch

from eviction_harness import by_score, make_method, ref_keep
from sparsevllm.attention.torch_ref import attention_mass
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sparse.base import SeqStep

HQ, HKV, D = 4, 2, 8
SCALE = 1.0 / math.sqrt(D)


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


class Reference:
    """One layer of R-KV, from the definition."""

    def __init__(self, budget, interval, window, lam, sink, recent):
        self.b, self.i, self.w, self.lam, self.sink, self.recent = (
            budget,
            interval,
            window,
            lam,
            sink,
            recent,
        )
        self.held: list[list[int]] = [[] for _ in range(HKV)]
        self.votes: list[tuple[int, list[dict[int, float]]]] = []  # (end, per head)

    def step(self, q, k, start, n, prompt) -> None:
        for h in range(HKV):
            self.held[h] += list(range(start, start + n))
        group = HQ // HKV
        per_head: list[dict[int, float]] = []
        for h in range(HKV):
            acc: dict[int, float] = {}
            for t in range(start + n - min(n, self.w), start + n):
                seen = [j for j in self.held[h] if j <= t]
                for g in range(h * group, (h + 1) * group):
                    logits = [float(q[t, g] @ k[j, h]) * SCALE for j in seen]
                    top = max(logits)
                    e = [math.exp(x - top) for x in logits]
                    for j, x in zip(seen, e):
                        acc[j] = acc.get(j, 0.0) + x / sum(e) / group
            per_head.append(acc)
        self.votes.append((start + n, per_head))
        end = start + n
        length = len(self.held[0])
        if start < prompt <= end:  # the prompt is cut once, at its end
            if length > self.b:
                self.compress(k, end)
        elif start >= prompt and length > self.b + self.i:  # decode bursts
            self.compress(k, end)

    def compress(self, k, end) -> None:
        for h in range(HKV):
            held = self.held[h]
            imp = [0.0] * len(held)
            for vend, per_head in self.votes:
                if vend > end - self.w:
                    for a, j in enumerate(held):
                        imp[a] += per_head[h].get(j, 0.0)
            total = sum(imp)
            imp = [x / total for x in imp] if total > 0 else imp
            mean_cos = [
                sum(cos(k[i, h], k[j, h]) for i in held if i != j) / (len(held) - 1) for j in held
            ]
            top = max(mean_cos)
            e = [math.exp(x - top) for x in mean_cos]
            red = [x / sum(e) for x in e]
            score = [self.lam * a - (1 - self.lam) * r for a, r in zip(imp, red)]
            keep = ref_keep(by_score(score), len(held), self.b, self.sink, self.recent)
            self.held[h] = [held[a] for a in keep]


def run_method(m, q, k, steps, prompt):
    """Drive the method on a real pool (one layer); the resident count after each step."""
    total = sum(steps)
    pool = KVPool(total + 8, 1, m.layer_groups())
    k_cache = torch.zeros(total + 8, HKV, D, dtype=torch.float64)
    kv = RunnerKV(pool, [DenseStorage.wrap(k_cache, torch.zeros_like(k_cache))])
    start, resident = 0, []
    for n in steps:
        k_cache[torch.tensor(pool.append(0, n)[0])] = k[start : start + n]
        step = SeqStep(0, 0, start, n, prompt)
        rows = m.score_rows(step)
        scores = {0: [attention_mass(q[start + n - rows : start + n], kv.keys(0, 0), SCALE)]}
        m.after_step([step], scores, kv)
        start += n
        resident.append(kv.resident(0, 0))
    return kv.logical_positions(0, 0).long(), resident


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "prompt, chunks, budget, interval, window, lam, sink, recent",
    [
        (20, [20], 12, 5, 4, 0.1, 2, 2),
        (30, [13, 13, 4], 10, 6, 3, 0.5, 1, 3),
        (8, [8], 10, 4, 8, 1.0, 0, 2),  # lambda 1: importance only
        (16, [16], 10, 3, 2, 0.0, 2, 0),  # lambda 0: redundancy only
    ],
)
def test_rkv_matches_reference(seed, prompt, chunks, budget, interval, window, lam, sink, recent):
    decode = 23
    g = torch.Generator().manual_seed(seed)
    total = prompt + decode
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    k[::3] += 2.0 * k[1]  # near-duplicate keys: redundancy has something to find
    m = make_method(
        "rkv",
        1,
        HKV,
        decode_keep_tokens=budget,
        rkv_interval=interval,
        rkv_window_size=window,
        rkv_lambda=lam,
        sink_keep_tokens=sink,
        recent_keep_tokens=recent,
    )
    steps = chunks + [1] * decode
    kept, resident = run_method(m, q, k, steps, prompt)
    ref = Reference(budget, interval, window, lam, sink, recent)
    start = 0
    for n in steps:
        ref.step(q, k, start, n, prompt)
        start += n
    assert max(resident[len(chunks) - 1 :]) <= budget + interval
    for h in range(HKV):
        assert kept[h].tolist() == ref.held[h], h


def test_rkv_long_generation_stays_within_budget_plus_interval():
    budget, interval = 16, 5
    m = make_method(
        "rkv", 1, HKV, decode_keep_tokens=budget, rkv_interval=interval, recent_keep_tokens=4
    )
    g = torch.Generator().manual_seed(0)
    total = 10 + 150
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    _, resident = run_method(m, q, k, [10] + [1] * 150, 10)
    assert max(resident) == budget + interval  # it fills the buffer, then compresses
    assert resident[-1] >= budget and resident.count(budget) > 10
    assert m.decode_resident(10, 150) == budget + interval
    m.release(0)
    assert m._votes == {}


def test_rkv_lambda_above_one_is_rejected():
    with pytest.raises(ValueError, match="rkv_lambda must be <= 1"):
        make_method("rkv", 1, HKV, rkv_lambda=1.5)
