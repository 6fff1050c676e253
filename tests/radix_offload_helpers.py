"""Helpers shared by the radix offload tests (tests/engine/test_radix_*.py)."""

from __future__ import annotations

import torch

from engine_helpers import run_request
from sparsevllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FIRST = [1] + [(5 * i) % 240 + 3 for i in range(199)]  # 200 tokens
NEW = [9, 8, 7]
# A finished 200-token request caches 209 slots: three fit in 700, a fourth pushes the
# least recently used one out.
PRESSURE = dict(num_kv_slots=700, chunk_prefill_size=256, max_model_len=1024)


def run_one(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    return run_request(llm.engine, prompt, params)[0]


def other(j: int) -> list[int]:
    return [2 + j] + [(7 * i + j) % 240 + 3 for i in range(199)]


def squeeze(llm: LLM, n: int = 3, start: int = 0) -> None:
    for j in range(start, start + n):
        run_one(llm, other(j))


def cached_rows(llm: LLM, tokens: list[int]):
    """The cached prefix of `tokens`: its slots' K/V rows in every layer and the logical
    position of each slot (read through the tree, which restores offloaded nodes)."""
    cache, runner = llm.engine.store.tree, llm.engine.runner
    _, node = cache.match(tokens)
    slots, positions = cache.view(node)
    index = torch.tensor(slots)
    rows = [
        (k[index].clone(), v[index].clone()) for k, v in ((s.k, s.v) for s in runner.kv_storage)
    ]
    return rows, positions


def same_rows(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(k0, k1) and torch.equal(v0, v1) for (k0, v0), (k1, v1) in zip(a, b)
    )


def borrowed_rows(llm: LLM, rid: str, n: int):
    """After one step: the first `n` entries of a running request's view."""
    engine = llm.engine
    table = torch.tensor(engine.pool.table(engine._by_request[rid].seq_id)[:n])
    runner = engine.runner
    return [
        (k[table].clone(), v[table].clone()) for k, v in ((s.k, s.v) for s in runner.kv_storage)
    ]
