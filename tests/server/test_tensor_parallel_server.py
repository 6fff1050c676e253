"""The server over a tensor-parallel engine (two CPU ranks): the openai client gets the
tokens one rank gives, a chain continues across turns, shutdown stops the worker rank."""

from __future__ import annotations

import os
import signal
from typing import Any

import openai
import pytest

from .conftest import TINY_NAME, snapkv_chain_config, start_server
from .test_chain import converse

GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}


def conversation(config) -> tuple[list[str], list[str]]:
    running = start_server(config, served_model_name=TINY_NAME)
    try:
        client = running.client()
        done = client.completions.create(model=TINY_NAME, prompt="w5 w6 w7 w8 w9", **GREEDY)
        turns = converse(client, "w1 w2 w3 w4 w5 w6", 3, extra_body={"chain_id": "conv-1"})
        ranks = running.engine._engine.ranks
    finally:
        running.stop()
    if ranks is not None:
        assert not any(p.is_alive() for p in ranks.procs)  # shutdown stopped the worker
    return [done.choices[0].text], [t.choices[0].message.content for t in turns]


def test_server_with_two_ranks_answers_as_one(tiny_path: str):
    one = snapkv_chain_config(tiny_path, 16, enable_prefix_caching=True, device="cpu")
    two = snapkv_chain_config(
        tiny_path, 16, enable_prefix_caching=True, device="cpu", tensor_parallel_size=2
    )
    assert conversation(two) == conversation(one)


def test_a_dead_rank_fails_requests_with_its_error(tiny_path: str):
    config = snapkv_chain_config(
        tiny_path, 16, enable_prefix_caching=True, device="cpu", tensor_parallel_size=2
    )
    running = start_server(config, served_model_name=TINY_NAME)
    try:
        client = running.client()
        client.completions.create(model=TINY_NAME, prompt="w5 w6 w7", **GREEDY)
        worker = running.engine._engine.ranks.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        for prompt in ("w5 w6 w7", "w1 w2"):  # answered at once, every time
            with pytest.raises(openai.InternalServerError, match="rank 1 exited with code -9"):
                client.completions.create(model=TINY_NAME, prompt=prompt, **GREEDY)
    finally:
        running.stop()
