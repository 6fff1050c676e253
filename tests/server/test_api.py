"""The OpenAI API on a tiny random model, through the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from sparsevllm import LLM, SamplingParams

from .conftest import TINY_NAME, RunningServer

PROMPT = "w1 w2 w3 w4 w5"
MESSAGES = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w1 w2 w3"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def stream_completion_text(client: openai.OpenAI, **kwargs) -> tuple[str, list]:
    chunks = list(client.completions.create(model=TINY_NAME, stream=True, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def stream_chat_text(client: openai.OpenAI, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=TINY_NAME, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_health_and_unknown_routes(tiny_server: RunningServer):
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    assert models.data[0].max_model_len == 512  # extra fields pass through the client
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ok"}
    missing = httpx.get(tiny_server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    with pytest.raises(openai.NotFoundError) as e:
        tiny_server.client().models.retrieve("other-model")
    assert e.value.body["code"] == "model_not_found"


def test_completion_matches_offline_engine_and_stream(tiny_server: RunningServer, tiny_path):
    client = tiny_server.client()
    result = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=12, **GREEDY)
    offline = LLM(tiny_path, max_model_len=512, num_kv_slots=4096).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    choice = result.choices[0]
    assert choice.text == offline.text and choice.finish_reason == "length"
    assert result.object == "text_completion" and result.model == TINY_NAME
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 12
    assert result.usage.total_tokens == 17
    assert result.usage.prompt_tokens_details.cached_tokens == 0
    streamed, chunks = stream_completion_text(client, prompt=PROMPT, max_tokens=12, **GREEDY)
    assert streamed == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream_with_usage(tiny_server: RunningServer):
    client = tiny_server.client()
    result = client.chat.completions.create(
        model=TINY_NAME, messages=MESSAGES, max_completion_tokens=10, **GREEDY
    )
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.object == "chat.completion" and result.usage.completion_tokens == 10
    streamed, chunks = stream_chat_text(
        client,
        messages=MESSAGES,
        max_tokens=10,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    assert streamed == message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == result.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_string_never_leaks_into_the_stream(tiny_server: RunningServer):
    client = tiny_server.client()
    full = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=16, **GREEDY)
    text = full.choices[0].text
    words = text.split()
    starts, pos = [], 0
    for w in words:
        pos = text.index(w, pos)
        starts.append(pos)
        pos += len(w)
    # A two-word stop whose first occurrence starts at word k > 0: while generating,
    # the text ends with word k, the beginning of the stop string, for one step.
    stop = next(
        f"{words[k]} {words[k + 1]}"
        for k in range(1, len(words) - 1)
        if text.find(f"{words[k]} {words[k + 1]}") == starts[k]
    )
    expected = text[: text.find(stop)]
    kwargs = {"prompt": PROMPT, "max_tokens": 16, "stop": [stop], **GREEDY}
    stopped = client.completions.create(model=TINY_NAME, **kwargs).choices[0]
    assert stopped.text == expected and stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == stop
    streamed, chunks = stream_completion_text(client, **kwargs)
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_seeds_and_echo(tiny_server: RunningServer):
    client = tiny_server.client()
    common = {"model": TINY_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    many = client.completions.create(n=3, seed=5, **common)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.prompt_tokens == 5 and many.usage.completion_tokens <= 24
    for i, choice in enumerate(many.choices):  # sample i uses seed + i
        alone = client.completions.create(seed=5 + i, **common).choices[0]
        assert alone.text == choice.text
    echoed = client.completions.create(echo=True, seed=1, **common).choices[0]
    assert echoed.text.startswith(PROMPT)


def test_token_id_and_batched_prompts(tiny_server: RunningServer, tiny_tokenizer):
    client = tiny_server.client()
    ids = tiny_tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=TINY_NAME, prompt=ids, max_tokens=6, **GREEDY)
    by_text = client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(
        model=TINY_NAME, prompt=[[1, 7], [1, 9, 10]], n=2, max_tokens=3, **GREEDY
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 12
    texts = client.completions.create(model=TINY_NAME, prompt=["w1 w2", "w3"], max_tokens=2)
    assert len(texts.choices) == 2 and texts.usage.prompt_tokens == 3


def test_completion_logprobs(tiny_server: RunningServer):
    client = tiny_server.client()
    result = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(" " + t for t in lp.tokens) == result.choices[0].text  # word-level
    assert lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the most likely token
    streamed = client.completions.create(
        model=TINY_NAME, prompt=PROMPT, max_tokens=5, logprobs=3, stream=True, **GREEDY
    )
    tokens = [t for c in streamed for t in (c.choices[0].logprobs.tokens if c.choices else [])]
    assert tokens == lp.tokens


def test_chat_logprobs(tiny_server: RunningServer):
    client = tiny_server.client()
    kwargs = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    result = client.chat.completions.create(model=TINY_NAME, **kwargs, **GREEDY)
    content = result.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob == item.top_logprobs[0].logprob
        assert bytes(item.bytes).decode() == item.token
    _, chunks = stream_chat_text(tiny_server.client(), **kwargs, **GREEDY)
    streamed = [
        t.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert streamed == [item.token for item in content]


def test_context_length_errors(tiny_server: RunningServer):
    client = tiny_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY_NAME, prompt=PROMPT, max_tokens=10**12)
    assert e.value.body["param"] == "max_tokens" and "512" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY_NAME, prompt=" ".join(["w5"] * 600), max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=TINY_NAME, messages=MESSAGES, max_tokens=508)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=TINY_NAME, prompt=[1, 2, 256], max_tokens=1)
    assert "outside the vocabulary" in e.value.body["message"]


# ---------------------------------------------------------------- vLLM's extra routes


def test_version_tokenize_detokenize_with_vllm_field_names(
    tiny_server: RunningServer, tiny_tokenizer
):
    """Acceptance 4 of issue 24: /version, /tokenize and /detokenize as vLLM serves them."""
    url = tiny_server.url
    version = httpx.get(url + "/version")
    assert version.status_code == 200 and version.json() == {"version": "0.1.0"}
    body = httpx.post(url + "/tokenize", json={"model": TINY_NAME, "prompt": PROMPT}).json()
    ids = tiny_tokenizer.encode(PROMPT)
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    body = httpx.post(url + "/tokenize", json={"prompt": "w1 w2", "return_token_strs": True}).json()
    assert body["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    expected = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == list(expected.get("input_ids", expected))
    assert chat["count"] == len(chat["tokens"])
    back = httpx.post(url + "/detokenize", json={"model": TINY_NAME, "tokens": ids}).json()
    assert back == {"prompt": tiny_tokenizer.decode(ids)}


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": "w1", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "w1"}, 404, "model"),
        ("/tokenize", {"prompt": "w1", "add_special_token": True}, 400, "add_special_token"),
        ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": "w1"}, 400, "tokens"),
    ],
)
def test_tokenize_errors(tiny_server: RunningServer, route, body, status, param):
    response = httpx.post(tiny_server.url + route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_metrics_are_labelled_with_the_model_name(tiny_server: RunningServer):
    text = httpx.get(tiny_server.url + "/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples and all(f'model_name="{TINY_NAME}"' in line for line in samples)
    assert 'sparsevllm:request_success_total{model_name="tiny",finished_reason="stop"}' in text
