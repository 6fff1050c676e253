"""--reasoning-parser end to end: chat completions and responses, whole and streamed.

A scripted model: the tiny model's greedy reply is known, so a copy of it whose tokenizer
spells the reply's first token "<think>" and a later one "</think>" replies with a
reasoning block, deterministically (the weights and token ids are unchanged)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparsevllm import LLM, SamplingParams

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

PROMPT = "w5 w6 w7"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def thinking_model(tiny_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    llm = LLM(tiny_path, max_model_len=512, enable_prefix_caching=False)
    tok = llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reply = llm.generate([ids], params, use_tqdm=False)[0].token_ids
    llm.close()
    # The block opens at the first token and closes at the first later token that
    # differs from every token before it.
    close_at = next(i for i in range(2, len(reply)) if reply[i] not in reply[:i])
    path = Path(tmp_path_factory.mktemp("thinking")) / "model"
    shutil.copytree(tiny_path, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    words = {i: w for w, i in vocab.items()}
    renamed = {words[reply[0]]: "<think>", words[reply[close_at]]: "</think>"}
    spec["model"]["vocab"] = {renamed.get(w, w): i for w, i in vocab.items()}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    spell = {i: renamed.get(w, w) for i, w in words.items()}
    return {
        "path": str(path),
        "reasoning": " " + " ".join(spell[t] for t in reply[1:close_at]) + " ",
        "content": " " + " ".join(spell[t] for t in reply[close_at + 1 :]),
        "reasoning_tokens": close_at + 1,
    }


@pytest.fixture(scope="module")
def server(thinking_model: dict[str, Any]) -> Iterator[RunningServer]:
    config = tiny_config(thinking_model["path"])
    running = start_server(config, served_model_name=TINY_NAME, reasoning_parser="qwen3")
    yield running
    running.stop()


def chat(server: RunningServer, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_chat_splits_reasoning_from_content(server: RunningServer, thinking_model) -> None:
    message = chat(server).choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == thinking_model["reasoning"]
    assert message.content == thinking_model["content"]
    reasoning = content = ""
    for chunk in chat(server, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (thinking_model["reasoning"], thinking_model["content"])


def test_responses_carry_a_reasoning_item(server: RunningServer, thinking_model) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model=TINY_NAME, input=PROMPT, temperature=0.0)
    resp = client.responses.create(**kw, max_output_tokens=MAX_TOKENS)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == thinking_model["reasoning"]
    assert resp.output_text == thinking_model["content"]
    assert resp.usage.output_tokens_details.reasoning_tokens == thinking_model["reasoning_tokens"]
    events = list(client.responses.create(**kw, max_output_tokens=MAX_TOKENS, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == (thinking_model["reasoning"], thinking_model["content"])
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == resp.output_text
