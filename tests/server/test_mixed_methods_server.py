"""Per-request sparse methods through the server: the request fields, their 400s."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

PROMPT = " ".join(f"w{i}" for i in range(10, 90))  # 80 tokens, over every budget below
SNAPKV = {"sparse_method": "snapkv", "kv_budget": 24, "sparse_knobs": {"snapkv_window_size": 4}}


@pytest.fixture(scope="module")
def server(tiny_path: str) -> Iterator[RunningServer]:
    config = tiny_config(tiny_path, sparse_methods=["snapkv", "streamingllm"])
    running = start_server(config, served_model_name=TINY_NAME)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def single_method_text(tiny_path: str) -> str:
    """SnapKV's greedy reply from a server started with SnapKV and that budget."""
    config = tiny_config(
        tiny_path,
        sparse_method="snapkv",
        decode_keep_tokens=24,
        recent_keep_tokens=20,
        snapkv_window_size=4,
    )
    running = start_server(config, served_model_name=TINY_NAME)
    try:
        out = running.client().completions.create(
            model=TINY_NAME, prompt=PROMPT, max_tokens=12, temperature=0.0
        )
    finally:
        running.stop()
    return out.choices[0].text


def test_model_card_lists_the_served_methods(server: RunningServer):
    card = server.client().models.list().data[0]
    assert card.sparse_method == "vanilla"
    assert card.sparse_methods == ["vanilla", "snapkv", "streamingllm"]


def test_a_request_chooses_its_method_and_budget(server: RunningServer, single_method_text):
    client = server.client()
    kwargs = {"model": TINY_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    dense = client.completions.create(**kwargs)
    sparse = client.completions.create(**kwargs, extra_body=SNAPKV)
    assert sparse.choices[0].text == single_method_text
    assert sparse.choices[0].text != dense.choices[0].text  # the budget changed the reply
    chat = client.chat.completions.create(
        model=TINY_NAME,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        extra_body={"sparse_method": "streamingllm", "kv_budget": 16},
    )
    assert chat.usage.completion_tokens == 4
    response = client.responses.create(
        model=TINY_NAME, input=PROMPT, max_output_tokens=4, extra_body=SNAPKV
    )
    assert response.usage.output_tokens == 4
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=TINY_NAME, input=PROMPT, extra_body={"sparse_method": "h2o"})
    assert info.value.body["param"] == "sparse_method"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"sparse_method": "snapkvv"}, "sparse_method", "did you mean 'snapkv'"),
        ({"sparse_method": "h2o"}, "sparse_method", "--sparse-methods snapkv,streamingllm,h2o"),
        (
            {"sparse_knobs": {"snapkv_window": 4}, "sparse_method": "snapkv"},
            "sparse_knobs",
            "snapkv_window_size",
        ),
        ({"kv_budget": 32}, "kv_budget", "no KV budget knob"),
        ({"kv_budget": 0}, "kv_budget", None),
        ({"kv_budget": "most"}, "kv_budget", None),
        ({"min_accuracy": 0.9}, "min_accuracy", "kv_budget='auto'"),
    ],
)
def test_bad_choices_get_a_400_naming_the_field(server: RunningServer, body, param, message):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=4, extra_body=body)
    error = info.value.body
    assert error["param"] == param, error
    if message:
        assert message in error["message"]
    # The server keeps serving.
    ok = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens == 2
