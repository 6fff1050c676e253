"""Hundreds of malformed or hostile bodies: each gets a 4xx OpenAI-shaped error, no 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import TINY_NAME, RunningServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE = {
    COMPLETIONS: {"model": TINY_NAME, "prompt": "w1 w2", "max_tokens": 2},
    CHAT: {"model": TINY_NAME, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2},
}

WRONG_INT = ["5", 5.5, True, [], {}, "abc", 1e400]
WRONG_FLOAT = ["0.5", True, [], {}, "x", 1e400]
WRONG_BOOL = ["true", 1, 0, [], {}, "yes"]
WRONG_STR = [5, [], {}, True, 1.5]
SHARED_FIELDS: dict[str, list[Any]] = {
    **{f: WRONG_INT for f in ("max_tokens", "n", "top_k", "seed", "min_tokens")},
    **{
        f: WRONG_FLOAT
        for f in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        )
    },
    **{f: WRONG_BOOL for f in ("stream", "ignore_eos", "skip_special_tokens")},
    "include_stop_str_in_output": WRONG_BOOL,
    "model": WRONG_STR,
    "user": WRONG_STR,
    "stop": [5, [5], [""], "", {"a": 1}, ["w1"] * 65, [None]],
    "stop_token_ids": ["x", [-1], [1.5], 5, [True]],
    "stream_options": ["yes", {"include_usage": "yes"}, {"unknown": 1}, []],
    "logit_bias": [{"5": 1.0}, {"5": "x"}, [1], "x"],
}
OUT_OF_RANGE: dict[str, list[Any]] = {
    "max_tokens": [0, -1, -(10**12), 10**12, 10**100],
    "n": [0, -1, 129, 10**6],
    "temperature": [-1, -1e-9, -1e300],
    "top_p": [0, 1.5, -0.1, 1e300],
    "top_k": [-2, -(10**9)],
    "min_p": [-0.1, 1.1],
    "presence_penalty": [2.5, -3, 1e300],
    "frequency_penalty": [2.01, -1e300],
    "repetition_penalty": [0, -1],
    "min_tokens": [-1, 3],  # 3 > max_tokens (2)
}
COMPLETION_ONLY: dict[str, list[Any]] = {
    "prompt": [
        5,
        True,
        {},
        None,
        [[]],
        [1, "a"],
        [[1, "a"]],
        "",
        [],
        [-1],
        [10**30],
        [1.5],
        [[1], "a"],
        [None],
        [[[1]]],
        [256],
        " ".join(["w7"] * 200_000),
        list(range(7, 100_007)),
        ["w1"] * 10_000,
    ],  # fmt: skip
    "echo": WRONG_BOOL,
    "logprobs": [*WRONG_INT, -1, 21, 10**9],
    "best_of": [*WRONG_INT, 2, 0],
    "suffix": ["tail", 5],
}
CHAT_ONLY: dict[str, list[Any]] = {
    "messages": [
        [],
        "hi",
        None,
        [5],
        [None],
        {"role": "user"},
        [{"role": "user"}],
        [{"role": "bogus", "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": "x", "extra": 1}],
        [{"role": 5, "content": "x"}],
        [{"role": "user", "content": " ".join(["w3"] * 100_000)}],
    ],  # fmt: skip
    "logprobs": ["true", 1, []],
    "top_logprobs": [*WRONG_INT, -1, 21, 2],  # 2 without logprobs: true
    "max_completion_tokens": [*WRONG_INT, 0, -5, 10**9, 3],  # 3 differs from max_tokens
    "add_generation_prompt": WRONG_BOOL,
    "tools": [[{"type": "browser"}], [{"type": "function", "function": {}}], {}, "f"],
    "tool_choice": ["sometimes", {"type": "function"}, 1],
}
UNKNOWN = {"temprature": 1.0, "foo": {}, "functions": [], "response_format": {"type": "json"}}
RAW_BODIES = [
    b"", b"{", b"{'prompt': 'w1'}", b"null", b"[]", b"123", b'"text"', b"true",
    b'{"prompt": NaN}', b'{"prompt": "w1", "temperature": Infinity}', b"\xff\xfe\x00garbage",
    b"[" * 100_000, b'{"prompt": "w1"} trailing', b'{"max_tokens": ' + b"1" * 5000 + b"}",
    b"prompt=w1&max_tokens=5", b'{"prompt": "w1", "prompt": 5}', b'{"a":' * 50_000,
]  # fmt: skip


def cases() -> list[tuple[str, str, Any, str | None]]:
    """(path, id, body, expected param) for every generated case."""
    out: list[tuple[str, str, Any, str | None]] = []
    for path in (COMPLETIONS, CHAT):
        only = COMPLETION_ONLY if path == COMPLETIONS else CHAT_ONLY
        for kind, table in (("type", SHARED_FIELDS), ("range", OUT_OF_RANGE), ("own", only)):
            for field, values in table.items():
                for i, value in enumerate(values):
                    body = {**BASE[path], field: value}
                    if field == "stream_options":
                        body["stream"] = True
                    out.append((path, f"{kind}-{field}-{i}", body, field))
        for field, value in UNKNOWN.items():
            out.append((path, f"unknown-{field}", {**BASE[path], field: value}, field))
        for i, raw in enumerate(RAW_BODIES):
            out.append((path, f"raw-{i}", raw, None))
        missing = "prompt" if path == COMPLETIONS else "messages"
        out.append(
            (path, "missing", {k: v for k, v in BASE[path].items() if k != missing}, missing)
        )
        out.append((path, "too-large", b" " * (33 * 1024 * 1024), None))
    return out


def post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    # 1e400 is valid JSON that Python reads as inf (json.dumps would write Infinity).
    text = json.dumps(body).replace("Infinity", "1e400")
    return client.post(path, content=text.encode())  # and no JSON content type


@pytest.fixture(scope="module")
def responses(tiny_server: RunningServer) -> list[tuple[str, str, str | None, httpx.Response]]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        return [(p, i, param, post(client, p, body)) for p, i, body, param in cases()]


def test_every_hostile_body_gets_a_4xx_openai_error(responses):
    assert len(responses) >= 300
    failures = []
    for path, case, param, r in responses:
        try:
            error = r.json()["error"]
            assert 400 <= r.status_code < 500
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            if param is not None and r.status_code == 400:
                assert error["param"] is not None and error["param"].split(".")[0] in (
                    param,
                    "prompt",
                    "messages",
                    "max_tokens",
                ), error
        except Exception as e:  # collect them all: one report beats one failure at a time
            failures.append(f"{path} {case}: {r.status_code} {r.text[:200]} ({e!r})")
    assert not failures, "\n".join(failures)


def test_errors_name_the_field(responses):
    by_case = {(p, c): r for p, c, _, r in responses}
    assert by_case[(COMPLETIONS, "unknown-temprature")].json()["error"]["message"] == (
        "unknown field 'temprature'"
    )
    error = by_case[(COMPLETIONS, "type-max_tokens-0")].json()["error"]
    assert error["param"] == "max_tokens" and "(got '5')" in error["message"]
    assert by_case[(CHAT, "own-messages-8")].json()["error"]["param"] == "messages.0.content"
    assert by_case[(COMPLETIONS, "type-model-0")].status_code == 400
    assert by_case[(COMPLETIONS, "too-large")].status_code == 413
    assert by_case[(COMPLETIONS, "raw-0")].json()["error"]["code"] == "invalid_json"


def test_server_still_serves_after_the_barrage(responses, tiny_server: RunningServer):
    assert all(r.status_code < 500 for *_, r in responses)
    m = tiny_server.wait_idle()
    assert m["sparsevllm:num_requests_running"] == 0 and m["sparsevllm:kv_slots_used"] == 0
    result = tiny_server.client().completions.create(model=TINY_NAME, prompt="w1 w2", max_tokens=3)
    assert result.usage.completion_tokens >= 1
    assert httpx.get(tiny_server.url + "/health").status_code == 200
