"""Ada-KV against a plain reference of its definition (float64, Python loops).

Reference, per layer at the end of the prompt: SnapKV's vote of token j for KV head h is
the softmax attention of the last W prompt queries (causal), summed over the window and
averaged over h's query heads (no pooling here). Each head keeps the first `sink` and the
last `recent`; of the middle, each head first takes its n_safe = max(1, floor(alpha x m))
best (m = budget - sink - recent), then the best remaining (head, token) pairs over all
heads until m x Hkv middle pairs are taken. The method runs on the real KV storage; the
test reads which logical tokens each head holds, which of them its decode views read, and
that decode views add every generated token.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from eviction_harness import make_method
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.attention.torch_ref import attention_mass
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sparse.adakv import AdaKV, adaptive_keep
from sparsevllm.sparse.base import SeqStep

HQ, HKV, D, LAYERS = 4, 2, 8, 2
SCALE = 1.0 / math.sqrt(D)


def ref_votes(q: torch.Tensor, k: torch.Tensor, window: int) -> list[list[float]]:
    """`[Hkv][L]` window votes of queries `[L, Hq, D]` over keys `[L, Hkv, D]`."""
    length, group = k.shape[0], HQ // HKV
    votes = [[0.0] * length for _ in range(HKV)]
    for i in range(length - window, length):
        for h in range(HQ):
            logits = [float(q[i, h] @ k[j, h // group]) * SCALE for j in range(i + 1)]
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            for j in range(i + 1):
                votes[h // group][j] += e[j] / sum(e) / group
    return votes


def ref_adakv(votes: list[list[float]], budget: int, sink: int, recent: int, alpha: float):
    """Per head: the sorted positions it reads (sink + its chosen middle + recent)."""
    length = len(votes[0])
    m = budget - sink - recent
    safe = max(1, int(m * alpha)) if alpha > 0 else 0
    middle = range(sink, length - recent)
    chosen: list[set[int]] = []
    for row in votes:
        best = sorted(middle, key=lambda j: -row[j])
        chosen.append(set(best[:safe]))
    rest = sorted(
        ((votes[h][j], h, j) for h in range(HKV) for j in middle if j not in chosen[h]),
        reverse=True,
    )
    for _, h, j in rest[: m * HKV - safe * HKV]:
        chosen[h].add(j)
    edges = set(range(sink)) | set(range(length - recent, length))
    return [sorted(c | edges) for c in chosen]


def run_prompt(m: AdaKV, q: list[torch.Tensor], k: list[torch.Tensor], chunks: list[int]):
    """Prefill one sequence in `chunks` on a real pool, feeding the method the attention
    mass of the rows it asks for; then `decode` more tokens. Returns the KV access."""
    total = k[0].shape[0]
    pool = KVPool(total + 8, LAYERS, m.layer_groups())
    k_cache = [torch.zeros(total + 8, HKV, D, dtype=torch.float64) for _ in range(LAYERS)]
    v_cache = [torch.zeros_like(c) for c in k_cache]
    kv = RunnerKV(pool, [DenseStorage.wrap(kc, vc) for kc, vc in zip(k_cache, v_cache)])
    prompt, start = sum(chunks), 0
    for n in chunks + [1] * (total - prompt):
        new = pool.append(0, n)
        step = SeqStep(0, 0, start, n, prompt)
        scores = {}
        rows = m.score_rows(step)
        for layer in range(LAYERS):
            k_cache[layer][torch.tensor(new[pool.group_of_layer[layer]])] = k[layer][start:][:n]
            if rows:
                q_rows = q[layer][start + n - rows : start + n]
                scores[layer] = [attention_mass(q_rows, kv.keys(0, layer), SCALE)]
        m.after_step([step], scores, kv)
        start += n
    return kv


def random_qk(seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    q = [torch.randn(length, HQ, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    k = [torch.randn(length, HKV, D, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    return q, k


def one_row_step(kv: RunnerKV, step: SeqStep) -> SparseStep:
    """The sparse side of a one-row decode batch."""
    zeros = torch.zeros(1, dtype=torch.int32)
    return SparseStep([0], zeros, zeros.bool(), kv, steps=[step])


def views_of(m: AdaKV, kv: RunnerKV, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The method's decode views of sequence 0 at `layer` (a one-row batch)."""
    view_len = kv.resident(0, layer)
    batch = SimpleNamespace(
        group_of_layer=list(range(LAYERS)),
        view_lens=[[view_len] for _ in range(LAYERS)],
        q_lens=[1],
        sparse=one_row_step(kv, SeqStep(0, 0, 0, 1, 1)),
    )
    picked = m.select_views(layer, torch.zeros(1, HQ, D), batch)  # type: ignore[arg-type]
    assert picked is not None
    return picked


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "length, budget, sink, recent, alpha, chunks",
    [
        (50, 16, 2, 4, 0.2, [30, 20]),
        (40, 12, 0, 0, 0.5, [40]),
        (45, 20, 4, 4, 0.0, [7] * 6 + [3]),
        (40, 10, 2, 2, 1.0, [40]),  # alpha 1: every head keeps its own m (SnapKV)
    ],
)
def test_adakv_matches_reference(seed, length, budget, sink, recent, alpha, chunks):
    window, decode = 8, 3
    q, k = random_qk(seed, length + decode)
    m = make_method(
        "adakv",
        LAYERS,
        HKV,
        decode_keep_tokens=budget,
        sink_keep_tokens=sink,
        recent_keep_tokens=recent,
        snapkv_window_size=window,
        snapkv_pool_kernel_size=1,
        adakv_alpha_safeguard=alpha,
    )
    assert isinstance(m, AdaKV)
    kv = run_prompt(m, q, k, chunks)
    for layer in range(LAYERS):
        ref = ref_adakv(
            ref_votes(q[layer][:length], k[layer][:length], window), budget, sink, recent, alpha
        )
        assert sum(len(r) for r in ref) == budget * HKV  # the layer's pairs are shared
        held = kv.logical_positions(0, layer).long()  # [Hkv, width + decode]
        width = max(len(r) for r in ref)
        assert held.shape[1] == width + decode
        subset, lens = views_of(m, kv, layer)
        for h in range(HKV):
            read = subset[0, h, : lens[0, h]].long()  # view positions this head reads
            assert held[h, read].tolist() == ref[h] + list(range(length, length + decode - 1))
            assert set(ref[h]) <= set(held[h, :width].tolist())  # its next best pad it
        if alpha == 1.0:
            assert all(len(r) == budget for r in ref)
        counts = [int(c) for c in lens[0] - (decode - 1)]
        assert counts == [len(r) for r in ref]


def test_adakv_heads_compete_for_the_layer_budget():
    # Head 0 scores every middle token above head 1: head 1 keeps only its safeguard.
    scores = torch.stack([torch.linspace(2.0, 3.0, 30), torch.linspace(0.0, 1.0, 30)])
    keep, read = adaptive_keep(scores, budget=12, sink=2, recent=2, alpha=0.25)
    assert read.sum(dim=1).tolist() == [2 + 14 + 2, 2 + 2 + 2]  # m = 8, n_safe = 2
    assert keep.shape == (2, 18)  # the view is as wide as head 0's selection
    assert keep[0].tolist() == [0, 1, *range(14, 28), 28, 29]
    assert keep[1][read[1]].tolist() == [0, 1, 26, 27, 28, 29]  # its own best two
    assert keep[1].tolist() == [0, 1, *range(14, 28), 28, 29]  # padded with its next best


def test_adakv_within_budget_reads_everything_and_admission_counts_the_worst_head():
    q, k = random_qk(0, 24)
    m = make_method("adakv", LAYERS, HKV, decode_keep_tokens=30, recent_keep_tokens=4)
    assert isinstance(m, AdaKV)
    kv = run_prompt(m, q, k, [20])
    assert [kv.resident(0, la) for la in range(LAYERS)] == [24, 24]
    batch = SimpleNamespace(
        group_of_layer=[0, 1],
        view_lens=[[24], [24]],
        q_lens=[1],
        sparse=one_row_step(kv, SeqStep(0, 0, 23, 1, 20)),
    )
    assert m.select_views(0, torch.zeros(1, HQ, D), batch) is None  # type: ignore[arg-type]
    # budget 30 = 4 sink + 4 recent + 22 middle; safeguard 4: the other head may take
    # 2 x 22 - 4 = 40 middle tokens of a long prompt.
    assert m.decode_resident(1000, 10) == 4 + 4 + 40 + 10
    assert m.decode_resident(40, 10) == 40 + 10  # the whole prompt at most
    assert m.max_resident(1000, 10) == 1000
    m.release(0)
    assert m._rows == {}


def test_adakv_alpha_above_one_is_rejected():
    with pytest.raises(ValueError, match="adakv_alpha_safeguard must be <= 1"):
        make_method("adakv", LAYERS, HKV, adakv_alpha_safeguard=1.5)
