"""A sparse method (SnapKV, small budget) served end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from .conftest import TINY_NAME, RunningServer, snapkv_chain_config, start_server

BUDGET = 16
LONG_PROMPT = " ".join(f"w{i}" for i in range(10, 130))  # 120 tokens, far over the budget


@pytest.fixture(scope="module")
def snapkv_server(tiny_path: str) -> Iterator[RunningServer]:
    config = snapkv_chain_config(tiny_path, BUDGET)
    running = start_server(config, served_model_name=TINY_NAME)
    yield running
    running.stop()


def test_snapkv_serves_completions_and_chat(snapkv_server: RunningServer):
    client = snapkv_server.client()
    card = client.models.list().data[0]
    assert card.sparse_method == "snapkv"
    kwargs = {"prompt": LONG_PROMPT, "max_tokens": 24, "temperature": 0.0}
    kwargs["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(model=TINY_NAME, **kwargs)
    assert full.usage.prompt_tokens == 120 and full.usage.completion_tokens == 24
    stream = client.completions.create(model=TINY_NAME, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
    chat = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=8,
        logprobs=True,
        top_logprobs=1,
    )
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content) <= 8


def test_snapkv_keeps_the_budget_under_concurrency(snapkv_server: RunningServer):
    async def one(client, i: int) -> int:
        result = await client.completions.create(
            model=TINY_NAME,
            prompt=LONG_PROMPT + f" w{i}",
            max_tokens=40,
            extra_body={"ignore_eos": True},
        )
        return result.usage.completion_tokens

    async def run_all() -> list[int]:
        async with snapkv_server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert asyncio.run(run_all()) == [40] * 8
    m = snapkv_server.wait_idle()
    assert m["sparsevllm:kv_slots_used"] == 0
    # Dense KV would need 8 x (121 + 40) slots at the end; SnapKV keeps ~the budget per
    # request once prefilled (the peak includes prompts being prefilled in chunks).
    assert m["sparsevllm:kv_slots_peak"] < 8 * (121 + 40)
    assert m["sparsevllm:max_concurrent_requests"] > 1
