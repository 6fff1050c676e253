"""Shared by the reference tests of score-eviction methods (KeyDiff, LagKV, Strided): drive
a method over one sequence on the real KV storage, and the plain definition of the
selection every `ScoreEviction` makes.

`run_sequence` appends each step's K/V to a `KVPool` with the method's layer groups
(`DenseStorage` + `RunnerKV`, so per-head compaction really moves rows and `keys` /
`values` read them back), calls `after_step`, and reads which logical token every head
of every layer still holds (`RunnerKV.logical_positions`).
"""

from __future__ import annotations

import torch

from sparsevllm.config import EngineConfig
from sparsevllm.engine.kv_access import RunnerKV
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.registry import create_method
from sparsevllm.sparse.score_eviction import ScoreEviction


def make_method(method: str, num_layers: int, num_kv_heads: int, **knobs) -> ScoreEviction:
    config = EngineConfig.create(sparse_method=method, **knobs)
    m = create_method(config, num_layers, num_kv_heads)
    assert isinstance(m, ScoreEviction)
    return m


def run_sequence(
    method: ScoreEviction,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    steps: list[int],
    prompt_len: int,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Run `steps` (tokens per step: prompt chunks, then decode steps of 1) of sequence 0.

    keys/values: per layer `[T, Hkv, D]` for every token the steps compute. Returns the
    kept logical positions per layer (`[Hkv, B]`, ascending per head) and the resident
    count per layer after every step."""
    num_layers, total = len(keys), sum(steps)
    pool = KVPool(total + 8, num_layers, method.layer_groups())
    k_cache = [torch.zeros(total + 8, *k.shape[1:], dtype=k.dtype) for k in keys]
    v_cache = [torch.zeros(total + 8, *v.shape[1:], dtype=v.dtype) for v in values]
    kv = RunnerKV(pool, [DenseStorage.wrap(k, v) for k, v in zip(k_cache, v_cache)])
    resident, start = [], 0
    for n in steps:
        new = pool.append(0, n)
        for layer in range(num_layers):
            slots = torch.tensor(new[pool.group_of_layer[layer]])
            k_cache[layer][slots] = keys[layer][start : start + n]
            v_cache[layer][slots] = values[layer][start : start + n]
        method.after_step([SeqStep(0, 0, start, n, prompt_len)], {}, kv)
        start += n
        resident.append([kv.resident(0, layer) for layer in range(num_layers)])
    kept = [kv.logical_positions(0, pool.group_of_layer[la]).long() for la in range(num_layers)]
    return kept, resident


def ref_keep(priority: list[int], length: int, budget: int, sink: int, recent: int) -> list[int]:
    """Definition of the selection: everything if it fits; else the first `sink`, the last
    `recent`, and the first `budget - sink - recent` middle positions of `priority` (the
    tokens in the order they are to be kept)."""
    if budget >= length:
        return list(range(length))
    middle = set(range(sink, length - recent))
    best = [p for p in priority if p in middle][: budget - sink - recent]
    return sorted([*range(sink), *best, *range(length - recent, length)])


def by_score(scores: list[float]) -> list[int]:
    """Positions from the highest score to the lowest (the newer first on a tie)."""
    return sorted(range(len(scores)), key=lambda j: (-scores[j], -j))
