"""POST /v1/cache/prune over plain HTTP: good bodies, bad bodies, 404 and 409."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .conftest import TINY_NAME, RunningServer, start_server, tiny_config

PROMPT = list(range(100, 160))  # 60 token ids
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def radix_server(tiny_path: str) -> Iterator[RunningServer]:
    running = start_server(
        tiny_config(tiny_path, enable_prefix_caching=True), served_model_name=TINY_NAME
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def chain_server(tiny_path: str) -> Iterator[RunningServer]:
    config = tiny_config(tiny_path, sparse_method="knorm", enable_prefix_caching=True)
    running = start_server(config, served_model_name=TINY_NAME)
    yield running
    running.stop()


def complete(server: RunningServer, prompt: Any, **extra: Any) -> dict[str, Any]:
    body = {"model": TINY_NAME, "prompt": prompt, "logprobs": 0, **GREEDY, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def reply_ids(server: RunningServer, result: dict[str, Any]) -> list[int]:
    tokens = result["choices"][0]["logprobs"]["tokens"]
    return server.engine.tokenizer.convert_tokens_to_ids(tokens)


def prune(server: RunningServer, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/cache/prune", timeout=60, **{"json": body, **kwargs})


def listing(server: RunningServer) -> dict[str, Any]:
    response = httpx.get(server.url + "/v1/cache", timeout=30)
    assert response.status_code == 200
    return response.json()


def test_prune_a_radix_prefix_and_reuse_it(radix_server: RunningServer):
    first = complete(radix_server, PROMPT)
    radix_server.wait_idle()
    logical = len(PROMPT) + len(reply_ids(radix_server, first)) - 1
    assert {"tokens": logical, "logical_tokens": logical, "resident_slots": logical} in (
        listing(radix_server)["prefixes"]
    )
    body = {"prompt": PROMPT, "ranges": [[10, 50]], "method": "snapkv", "keep_ratio": 0.25}
    response = prune(radix_server, body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "cache.prune" and result["kind"] == "prefix"
    assert result["logical_tokens"] == len(PROMPT) and result["slots_freed"] == 30
    assert result["ranges"] == [[10, 50]] and result["method"] == "snapkv"
    entry = {"tokens": logical, "logical_tokens": logical, "resident_slots": logical - 30}
    assert entry in listing(radix_server)["prefixes"]
    # The next turn reuses the whole (pruned) history.
    follow = complete(radix_server, PROMPT + reply_ids(radix_server, first) + [7, 7])
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == logical
    assert follow["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_prune_a_chain_by_id_and_by_text(chain_server: RunningServer):
    first = complete(chain_server, PROMPT, chain_id="conv-p")
    history = PROMPT + reply_ids(chain_server, first)
    response = prune(chain_server, {"chain_id": "conv-p", "ranges": [[0, 40]], "keep_ratio": 0.5})
    assert response.status_code == 200, response.text
    assert response.json()["slots_freed"] == 20 and response.json()["method"] == "knorm"
    entry = next(c for c in listing(chain_server)["chains"] if c["chain_id"] == "conv-p")
    assert (entry["logical_tokens"], entry["resident_slots"]) == (
        len(history) - 1,
        len(history) - 21,
    )
    follow = complete(chain_server, history + [7, 7], chain_id="conv-p")
    assert follow["chain_status"] == "continued"
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
    # A text prompt is tokenized and names the chain whose history it starts.
    text = complete(chain_server, "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10", chain_id="conv-t")
    assert text["chain_status"] == "not_found"
    body = {"prompt": "w1 w2 w3 w4 w5", "ranges": [[2, 8]], "keep_ratio": 0.5}
    response = prune(chain_server, body)
    assert response.status_code == 200, response.text
    assert response.json()["chain_id"] == "conv-t" and response.json()["slots_freed"] == 3


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"chain_id": "nope", "ranges": [[0, 4]], "keep_ratio": 0.5}, 404, "no chain 'nope'"),
        ({"prompt": [7] * 30, "ranges": [[0, 4]], "keep_ratio": 0.5}, 404, "no chain's history"),
        ({"ranges": [[0, 4]], "keep_ratio": 0.5}, 400, "give exactly one"),
        ({"chain_id": "x", "prompt": "w1", "ranges": [[0, 4]], "keep_ratio": 0.5}, 400, "one"),
        ({"chain_id": "x", "keep_ratio": 0.5}, 400, "ranges: this field is required"),
        ({"chain_id": "x", "ranges": [[0, 4]]}, 400, "keep_ratio: this field is required"),
        ({"chain_id": "x", "ranges": [[0, 4]], "keep_ratio": 0}, 400, "greater than 0"),
        ({"chain_id": "x", "ranges": [[0, 4]], "keep_ratio": 1.5}, 400, "less than or equal"),
        ({"chain_id": "x", "ranges": [[0, 4]], "keep_ratio": "1"}, 400, "keep_ratio"),
        ({"chain_id": "x", "ranges": [], "keep_ratio": 0.5}, 400, "ranges"),
        ({"chain_id": "x", "ranges": [[1]], "keep_ratio": 0.5}, 400, "ranges.0"),
        ({"chain_id": "x", "ranges": [[4, 2]], "keep_ratio": 0.5}, 400, "0 <= start < end"),
        ({"chain_id": "x", "ranges": [[0, 4], [2, 6]], "keep_ratio": 0.5}, 400, "overlap"),
        ({"chain_id": "x", "ranges": [[0, 4]], "keep_ratio": 0.5, "method": "h2o"}, 400, "knorm"),
        ({"chain_id": "x", "ranges": [[0, 4]], "keep_ratio": 0.5, "bogus": 1}, 400, "'bogus'"),
        ({"chain_id": "a b", "ranges": [[0, 4]], "keep_ratio": 0.5}, 400, "visible ASCII"),
        ({"prompt": "", "ranges": [[0, 4]], "keep_ratio": 0.5}, 400, "prompt is empty"),
    ],
)
def test_bad_bodies_and_unknown_targets(chain_server: RunningServer, body, status, needle):
    response = prune(chain_server, body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_body_that_is_not_a_json_object(chain_server: RunningServer):
    response = prune(chain_server, None, content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = prune(chain_server, [1, 2])
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]


def test_range_past_the_history_and_radix_errors(radix_server, chain_server):
    complete(chain_server, PROMPT, chain_id="conv-short")
    body = {"chain_id": "conv-short", "ranges": [[0, 500]], "keep_ratio": 0.5}
    response = prune(chain_server, body)
    assert response.status_code == 400 and "ends past the" in response.json()["error"]["message"]
    response = prune(radix_server, {"chain_id": "c", "ranges": [[0, 4]], "keep_ratio": 0.5})
    assert response.status_code == 400 and "radix prefix cache" in response.text
    response = prune(radix_server, {"prompt": [9] * 20, "ranges": [[0, 4]], "keep_ratio": 0.5})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_a_history_in_use_is_refused_with_409(chain_server: RunningServer):
    first = complete(chain_server, PROMPT[:20], chain_id="conv-busy")
    follow = PROMPT[:20] + reply_ids(chain_server, first) + [7]
    body = {"model": TINY_NAME, "prompt": follow, "chain_id": "conv-busy", "stream": True}
    body.update(GREEDY, max_tokens=400)
    with httpx.stream("POST", chain_server.url + "/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        lines = s.iter_lines()  # kept: a collected iterator would close the stream
        assert '"chain_status": "continued"' in next(lines)  # it runs, extending the chain
        response = prune(
            chain_server, {"chain_id": "conv-busy", "ranges": [[0, 4]], "keep_ratio": 0.5}
        )
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "cache_busy"


def test_a_restarted_server_continues_the_chains_it_left_on_disk(tiny_path: str, tmp_path):
    config = tiny_config(
        tiny_path, sparse_method="knorm", enable_prefix_caching=True, disk_offload_dir=str(tmp_path)
    )
    server = start_server(config, served_model_name=TINY_NAME)
    try:
        first = complete(server, PROMPT, chain_id="saved")
        history = PROMPT + reply_ids(server, first)
    finally:
        server.stop()  # the worker writes its idle chains to disk on the way out
    later = start_server(config, served_model_name=TINY_NAME)
    try:
        entry = next(c for c in listing(later)["chains"] if c["chain_id"] == "saved")
        assert (entry["tier"], entry["logical_tokens"]) == ("disk", len(history) - 1)
        assert listing(later)["offload"]["disk_bytes"] > 0
        follow = complete(later, history + [7], chain_id="saved")
        assert follow["chain_status"] == "continued (restored from disk)"
        assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
    finally:
        later.stop()


def test_a_restarted_radix_server_reuses_the_prefixes_it_left_on_disk(tiny_path: str, tmp_path):
    config = tiny_config(tiny_path, enable_prefix_caching=True, disk_offload_dir=str(tmp_path))
    server = start_server(config, served_model_name=TINY_NAME)
    try:
        first = complete(server, PROMPT)
        history = PROMPT + reply_ids(server, first)
        assert "offloaded" in listing(server) and listing(server)["offloaded"] == []
    finally:
        server.stop()  # the worker writes the unlocked radix nodes to disk on the way out
    later = start_server(config, served_model_name=TINY_NAME)
    try:
        cache = listing(later)
        [node] = cache["offloaded"]
        assert (node["tier"], node["start"], node["logical_tokens"]) == (
            "disk",
            0,
            len(history) - 1,
        )
        assert node["bytes"] > 0 and cache["offload"]["disk_bytes"] >= node["bytes"]
        assert cache["prefixes"][0]["resident_slots"] == 0
        follow = complete(later, history + [7])
        assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history) - 1
        later.wait_idle()
        after = listing(later)
        assert after["offloaded"] == [] and after["offload"]["num_restored"] == 1
    finally:
        later.stop()
