"""Schema-driven fuzzing (fast slice): requests generated from the server's OpenAPI
document for every operation, valid and schema-breaking; no 5xx, every error in
OpenAI's shape, and the server still answers correctly afterwards.

The long run is `scripts/fuzz_api.py` (docs/reliability/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api_fuzz import check_one, error_shape_problem, fuzz

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": TINY_NAME, "prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0.0}
BODY_LIMIT = 256 * 1024


def fuzz_config(path: str) -> Any:
    # A short context keeps every generated completion short on CPU.
    return tiny_config(path, max_model_len=48, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def fuzz_server(tiny_path: str) -> Iterator[RunningServer]:
    running = start_server(
        fuzz_config(tiny_path),
        served_model_name=TINY_NAME,
        api_key=KEY,
        max_queue_len=16,
        max_body_bytes=BODY_LIMIT,
    )
    yield running
    running.stop()


def greedy_text(server: RunningServer) -> str:
    r = httpx.post(server.url + "/v1/completions", json=GREEDY, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_schema_documents_every_body_and_error(fuzz_server: RunningServer):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    posts = {path for path, item in doc["paths"].items() if "post" in item}
    assert posts == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/cache/prune",
        "/tokenize",
        "/detokenize",
    }
    for path in posts:
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["required"] and op["security"] == [{"bearer": []}]
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert completion["additionalProperties"] is False and completion["required"] == ["prompt"]
    n = completion["properties"]["n"]["anyOf"][0]
    assert (n["type"], n["minimum"], n["maximum"]) == ("integer", 1, 128)
    assert completion["properties"]["logit_bias"]["maxProperties"] == 0
    assert doc["paths"]["/health"]["get"].get("security") is None  # open, like /metrics


def test_generated_requests_get_no_5xx_and_openai_errors(fuzz_server: RunningServer):
    before = greedy_text(fuzz_server)
    report = fuzz(fuzz_server.url, max_examples=10, api_key=KEY)
    assert report.requests >= 100
    assert len(report.by_operation) == 14  # every operation of the document
    assert not report.failures, "\n".join(report.failures[:10])
    assert report.server_errors == 0
    # Alive, idle again, and the same greedy answer as before the barrage.
    m = fuzz_server.wait_idle()
    assert m["sparsevllm:num_requests_running"] + m["sparsevllm:num_requests_waiting"] == 0
    assert m["sparsevllm:kv_slots_used"] == m["sparsevllm:kv_slots_cached"]
    assert greedy_text(fuzz_server) == before
    assert httpx.get(fuzz_server.url + "/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_streamed_answers_match_the_documented_events(fuzz_server: RunningServer, path: str):
    """Regression (found by the random fuzz run): the event-stream schema described each
    event as a string, so every streamed 200 broke the documented schema."""
    body: dict[str, Any] = {"model": TINY_NAME, "max_tokens": 3, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = "w1 w2"
    elif path == "/v1/responses":
        body = {"model": TINY_NAME, "max_output_tokens": 3, "stream": True, "input": "w1"}
    else:
        body["messages"] = [{"role": "user", "content": "w1"}]
    assert check_one(fuzz_server.url, "POST", path, body, KEY) == []


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("GET", "/v1/cache", None),
        ("POST", "/v1/cache/prune", {"prompt": [1, 2], "ranges": [[0, 1]], "keep_ratio": 0.5}),
        ("POST", "/tokenize", {"prompt": "w1"}),
        ("POST", "/detokenize", {"tokens": [7]}),
        ("GET", "/v1/models", None),
    ],
)
def test_the_key_guards_cache_prune_and_tokenizer_routes(
    fuzz_server: RunningServer, method: str, path: str, body: Any
):
    for headers in ({}, {"Authorization": "Bearer sk-fuzz-wrong"}, {"Authorization": "sk-fuzz"}):
        r = httpx.request(method, fuzz_server.url + path, json=body, headers=headers)
        assert r.status_code == 401 and error_shape_problem(r) is None
    r = httpx.request(method, fuzz_server.url + path, json=body, headers=AUTH)
    assert r.status_code in (200, 404), r.text  # 404: no such cached prefix


def test_bodies_over_the_limit_are_refused_before_parsing(fuzz_server: RunningServer):
    url = fuzz_server.url + "/v1/completions"
    big = b'{"prompt": "' + b"w1 " * (BODY_LIMIT // 2) + b'"}'
    r = httpx.post(url, content=big, headers=AUTH)  # declared length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(url, content=chunks(), headers=AUTH)
    assert r.status_code == 413 and error_shape_problem(r) is None
    assert greedy_text(fuzz_server)  # and the server goes on


def test_tokenize_messages_with_special_tokens(fuzz_server: RunningServer):
    """Regression (found by the fuzzer): add_special_tokens with messages was a 500
    (transformers 5 tokenizers have no build_inputs_with_special_tokens)."""
    messages = [{"role": "user", "content": "w1 w2"}]
    plain = httpx.post(
        fuzz_server.url + "/tokenize", json={"messages": messages}, headers=AUTH
    ).json()
    r = httpx.post(
        fuzz_server.url + "/tokenize",
        json={"messages": messages, "add_special_tokens": True},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    # The template's tokens, with whatever the tokenizer adds around them.
    joined = ",".join(map(str, tokens))
    assert ",".join(map(str, plain["tokens"])) in joined and r.json()["count"] == len(tokens)


def test_stop_strings_are_bounded_per_string_and_per_list(fuzz_server: RunningServer):
    """Regression: a single stop string over 64 characters was refused as 'at most 64
    items' (the list bound applied to the string); now each string may hold 1,024."""

    def post(stop: Any) -> httpx.Response:
        body = {"model": TINY_NAME, "prompt": "w1", "max_tokens": 2, "stop": stop}
        return httpx.post(fuzz_server.url + "/v1/completions", json=body, headers=AUTH)

    assert post("w9 " * 40).status_code == 200  # 120 characters
    assert post(["w9"] * 64).status_code == 200
    for bad in ("x" * 1025, ["w9"] * 65, "", [""]):
        r = post(bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop"), r.text
