"""Plain references of bounded prefill (the rules of sparse/snapkv.py and sparse/h2o.py,
"Bounded prefill"), shared by the method-level and the engine-level reference tests, and
the harness that drives a method's hooks over the real compaction path (`run_hooks`).

SnapKV:

Float64 loops over chunks, KV heads and queries, in logical positions (no views, no
compaction): each KV head keeps a list of the tokens it holds; a query of head hq sees
the kept tokens of its KV head at positions <= its own, softmax(q.k * scale). Per layer:

1. chunk [s, e) with e > N - w: each of its queries in [N - w, N) adds its probabilities
   to the window votes (per query head, per token);
2. after a chunk with e < N, if the layer holds more than B tokens: the votes are the
   summed probabilities of the chunk's last min(w, e - s) queries when e <= N - w, else
   the window votes so far; averaged over each KV head's query heads, max-pooled along
   the head's kept tokens (kernel k, odd), and each head keeps its first `sink`, its last
   `recent` and the best B - sink - recent of the rest;
3. after the chunk with e = N, the same with the window votes, if more than B are held.

H2O (`ref_bounded_h2o`): every query of every chunk adds its probabilities, averaged over
its KV head's query heads, to the tokens' cumulative scores; after every chunk a layer
holding more than B keeps sink + recent + the best cumulative scores (no pooling).
"""

from __future__ import annotations

import math

import torch

from sparsevllm.attention.torch_ref import attention_mass
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.score_eviction import ScoreEviction


def _probs(q: torch.Tensor, keys: torch.Tensor, scale: float) -> list[float]:
    logits = [float(keys[j] @ q) * scale for j in range(keys.shape[0])]
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    total = sum(e)
    return [x / total for x in e]


def _select(scores: list[float], budget: int, sink: int, recent: int) -> tuple[list[int], float]:
    """Indices (into `scores`) kept: first sink, last recent, best middle; and the gap
    between the last middle score kept and the best one dropped (near-ties make the
    choice ambiguous)."""
    n = len(scores)
    sink = min(sink, budget)
    recent = min(recent, budget - sink)
    middle = list(range(sink, n - recent))
    m = budget - sink - recent
    ranked = sorted(middle, key=lambda j: -scores[j])
    gap = math.inf
    if 0 < m < len(ranked):
        gap = scores[ranked[m - 1]] - scores[ranked[m]]
    chosen = set(range(sink)) | set(ranked[:m]) | set(range(n - recent, n))
    return sorted(chosen), gap


def _pool(row: list[float], kernel: int) -> list[float]:
    half = kernel // 2
    return [max(row[max(0, j - half) : j + half + 1]) for j in range(len(row))]


def ref_bounded_snapkv(
    q: torch.Tensor,
    k: torch.Tensor,
    chunks: list[int],
    budget: int,
    sink: int,
    recent: int,
    window: int,
    kernel: int,
    scale: float,
) -> tuple[list[list[int]], float]:
    """q `[N, Hq, D]`, k `[N, Hkv, D]` (post-RoPE) of one layer, prefilled in `chunks`:
    the logical positions each KV head keeps after the prompt, and the smallest cut gap
    over every cut (a near-tie: the reference and the engine may choose differently)."""
    n_total, hq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    q, k = q.double(), k.double()
    kept: list[list[int]] = [[] for _ in range(hkv)]
    votes: list[dict[int, float]] = [{} for _ in range(hq)]  # window votes per query head
    gap, start = math.inf, 0
    w_start = n_total - window

    def attend(p: int, head: int) -> list[tuple[int, float]]:
        seen = [j for j in kept[head // group] if j <= p]
        return list(zip(seen, _probs(q[p, head], k[seen, head // group], scale)))

    for size in chunks:
        end = start + size
        for h in range(hkv):
            kept[h] += list(range(start, end))
        in_window = end > w_start
        if in_window:
            for p in range(max(start, w_start), end):
                for head in range(hq):
                    for j, pr in attend(p, head):
                        votes[head][j] = votes[head].get(j, 0.0) + pr
        if len(kept[0]) > budget:
            moving = range(end - min(window, size), end)
            for h in range(hkv):
                per_q = []
                for head in range(h * group, (h + 1) * group):
                    if in_window:
                        per_q.append([votes[head].get(j, 0.0) for j in kept[h]])
                        continue
                    acc = dict.fromkeys(kept[h], 0.0)
                    for p in moving:
                        for j, pr in attend(p, head):
                            acc[j] += pr
                    per_q.append([acc[j] for j in kept[h]])
                mean = [sum(col) / group for col in zip(*per_q)]
                chosen, g = _select(_pool(mean, kernel), budget, sink, recent)
                gap = min(gap, g)
                kept[h] = [kept[h][i] for i in chosen]
        start = end
    return kept, gap


def ref_bounded_h2o(
    q: torch.Tensor,
    k: torch.Tensor,
    chunks: list[int],
    budget: int,
    sink: int,
    recent: int,
    scale: float,
) -> tuple[list[list[int]], float]:
    """Bounded H2O over one layer (see the module docstring): kept positions per KV head
    after the prompt, and the smallest cut gap."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    q, k = q.double(), k.double()
    kept: list[list[int]] = [[] for _ in range(hkv)]
    acc: list[dict[int, float]] = [{} for _ in range(hkv)]
    gap, start = math.inf, 0
    for size in chunks:
        end = start + size
        for h in range(hkv):
            kept[h] += list(range(start, end))
            for p in range(start, end):
                seen = [j for j in kept[h] if j <= p]
                for head in range(h * group, (h + 1) * group):
                    for j, pr in zip(seen, _probs(q[p, head], k[seen, h], scale)):
                        acc[h][j] = acc[h].get(j, 0.0) + pr / group
            if len(kept[h]) > budget:
                chosen, g = _select([acc[h][j] for j in kept[h]], budget, sink, recent)
                gap = min(gap, g)
                kept[h] = [kept[h][i] for i in chosen]
        start = end
    return kept, gap


def run_hooks(
    method: ScoreEviction,
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    chunks: list[int],
    scale: float,
    bounded: bool = True,
) -> tuple[list[list[list[int]]], list[int], list[list[int]]]:
    """Prefill one sequence of sum(chunks) tokens through `method`'s hooks on a `KVPool`
    with its layer groups, `DenseStorage` and `RunnerKV` (cuts compact the views per KV
    head; each chunk's score rows are `attention_mass` over the current, compacted keys,
    as the backend computes them). q/k per layer: `[N, Hq, D]` / `[N, Hkv, D]`, fixed per
    logical position. Returns the kept logical positions per layer (`[Hkv][B]`), the
    score rows asked per chunk, and each layer's residency during each chunk (after its
    slots were added, before the method cut)."""
    layers, total = len(k), sum(chunks)
    hkv, dim = k[0].shape[1], k[0].shape[2]
    pool = KVPool(total + 8, layers, method.layer_groups())
    k_cache = [torch.zeros(total + 8, hkv, dim) for _ in range(layers)]
    v_cache = [torch.zeros(total + 8, hkv, dim) for _ in range(layers)]
    kv = RunnerKV(pool, [DenseStorage.wrap(kc, vc) for kc, vc in zip(k_cache, v_cache)])
    asked, peaks, start = [], [], 0
    for n in chunks:
        new = pool.append(0, n)
        for layer in range(layers):
            slots = torch.tensor(new[pool.group_of_layer[layer]])
            k_cache[layer][slots] = k[layer][start : start + n]
        step = SeqStep(0, 0, start, n, total, bounded)
        rows = method.score_rows(step)
        asked.append(rows)
        scores = {}
        if rows:
            for layer in range(layers):
                newest = q[layer][step.end - rows : step.end]  # [rows, Hq, D]
                scores[layer] = [attention_mass(newest, kv.keys(0, layer), scale)]
        peaks.append([kv.resident(0, layer) for layer in range(layers)])
        method.after_step([step], scores, kv)
        start += n
    kept = [kv.logical_positions(0, pool.group_of_layer[la]).tolist() for la in range(layers)]
    return kept, asked, peaks
