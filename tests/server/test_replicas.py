"""Engine replicas on Ray Serve (issue 20's acceptance 1 and 4): a local Ray instance,
2 replicas of the tiny model, the official openai client against the HTTP ingress."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.conftest import TINY_NAME, tiny_config
from sparsevllm.server.metrics import parse_metrics

ray = pytest.importorskip("ray")

from sparsevllm.server.replicas import launcher  # noqa: E402
from sparsevllm.server.replicas.options import ReplicaOptions, ServerOptions  # noqa: E402

SRC = str(Path(__file__).resolve().parents[2] / "src")
REPLICA_HEADER = "x-sparsevllm-replica"
# The tests on the 2-replica cluster: starting it (Ray, two engines) takes 40-60 s on a
# 2-core machine; all of them together, about 90 s.
CLUSTER = pytest.mark.slow


@dataclass
class Cluster:
    url: str
    options: ReplicaOptions
    resources: dict[str, float]
    stopped: bool = False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

    def metrics(self) -> dict[str, float]:
        response = httpx.get(self.url + "/metrics", timeout=30)
        assert response.status_code == 200, response.text
        return parse_metrics(response.text, keep_model_name=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_path: str) -> Iterator[Cluster]:
    # The replicas' worker processes import sparsevllm from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])
    port = _free_port()
    # The tiny model's whole context: the dead-replica test needs requests that are still
    # decoding when it kills a replica (a few hundred tokens took under 0.5 s).
    engine = tiny_config(tiny_path, enable_prefix_caching=True, cpu_threads=1, max_model_len=2048)
    options = ReplicaOptions(
        engine=engine, server=ServerOptions(TINY_NAME, port=port), replicas=2, replica_cpus=1
    )
    resources = launcher.connect(None, num_cpus=2)
    launcher.deploy(options, resources)
    running = Cluster(f"http://127.0.0.1:{port}", options, resources)
    yield running
    if not running.stopped:
        launcher.shutdown()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(7, 250)}" for _ in range(n))


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> tuple[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_NAME, messages=messages, max_tokens=8, **extra
    )
    return raw.headers[REPLICA_HEADER], raw.parse()


def _conversation(cluster: Cluster, index: int) -> tuple[str, str, int]:
    """Two turns (chat by prefix, chat with chain_id, or responses with
    previous_response_id by index): (turn 1's replica, turn 2's, turn 2's cached tokens)."""
    client, rng = cluster.client(), random.Random(index)
    if index % 4 == 3:
        first = client.responses.with_raw_response.create(
            model=TINY_NAME, input=_words(rng, 40), max_output_tokens=8
        )
        second = client.responses.with_raw_response.create(
            model=TINY_NAME,
            input=_words(rng, 5),
            previous_response_id=first.parse().id,
            max_output_tokens=8,
        )
        cached = second.parse().usage.input_tokens_details.cached_tokens
        return first.headers[REPLICA_HEADER], second.headers[REPLICA_HEADER], cached
    extra = {"extra_body": {"chain_id": f"conv-{index}"}} if index % 4 == 2 else {}
    messages = [{"role": "user", "content": _words(rng, 40)}]
    one, reply = _chat(client, messages, **extra)
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": _words(rng, 5)},
    ]
    two, reply = _chat(client, messages, **extra)
    return one, two, reply.usage.prompt_tokens_details.cached_tokens


@CLUSTER
def test_turn_two_lands_on_turn_ones_replica_with_cached_tokens(cluster):
    with ThreadPoolExecutor(4) as pool:
        turns = list(pool.map(lambda i: _conversation(cluster, i), range(20)))
    same = [(one, two, cached) for one, two, cached in turns if one == two]
    assert len(same) >= 19, turns  # at least 95%
    assert all(cached > 0 for _, _, cached in same), turns
    assert len({one for one, _, _ in turns}) == 2  # the conversations used both replicas
    metrics = cluster.metrics()
    assert metrics['sparsevllm:router_requests_total{outcome="hit"}'] >= 19


@CLUSTER
def test_independent_requests_spread_over_the_replicas(cluster):
    client = cluster.client()

    def one(i: int) -> str:
        rng = random.Random(1000 + i)
        return _chat(client, [{"role": "user", "content": _words(rng, 30)}])[0]

    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(one, range(40)))
    assert len(counts) == 2 and max(counts.values()) <= 26, counts  # no replica above 65%


@CLUSTER
def test_metrics_are_one_view_labelled_by_replica(cluster):
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    replicas = {
        line.split('replica="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("sparsevllm:prompt_tokens_total{")
    }
    assert len(replicas) == 2
    assert text.count("# TYPE sparsevllm:prompt_tokens_total ") == 1
    for outcome in ("hit", "miss", "overloaded", "lost"):
        assert f'sparsevllm:router_requests_total{{outcome="{outcome}"}}' in text
    assert cluster.metrics()["sparsevllm:router_replicas"] == 2


@CLUSTER
def test_too_many_replicas_fail_naming_the_resources(cluster):
    import dataclasses

    too_many = dataclasses.replace(cluster.options, replicas=5)
    with pytest.raises(launcher.ReplicaSetupError, match=r"needs 5 CPUs .* has 2 CPUs and 0 GPUs"):
        launcher.deploy(too_many, cluster.resources)


def _kill(cluster: Cluster, replica: str) -> None:
    name = f"SERVE_REPLICA::{cluster.options.app_name}#EngineReplica#{replica}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


@CLUSTER
def test_a_dead_replica_loses_no_unstreamed_request_and_reports_its_chains(cluster):
    client = cluster.client()
    doomed, _ = _chat(
        client, [{"role": "user", "content": "w9 w10"}], extra_body={"chain_id": "doomed"}
    )

    def long_request(i: int) -> tuple[int, str]:
        raw = client.completions.with_raw_response.create(
            model=TINY_NAME,
            prompt=_words(random.Random(2000 + i), 20),
            max_tokens=1900,  # most of max_model_len: still running when the kill comes
            extra_body={"ignore_eos": True},
        )
        return raw.http_response.status_code, raw.headers[REPLICA_HEADER]

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_request, i) for i in range(6)]
        time.sleep(0.5)  # the requests are running, on both replicas
        # A fast machine may finish one before the kill: its replica served it whole.
        running = [i for i, f in enumerate(futures) if not f.done()]
        _kill(cluster, doomed)
        results = [f.result(timeout=120) for f in futures]
    assert running, "every request finished before the kill: nothing was retried"
    assert [status for status, _ in results] == [200] * 6  # retried elsewhere
    assert doomed not in {results[i][1] for i in running}, (running, results)

    with pytest.raises(openai.APIStatusError) as lost:
        _chat(
            client, [{"role": "user", "content": "w9 w10 w11"}], extra_body={"chain_id": "doomed"}
        )
    assert lost.value.status_code == 410
    assert lost.value.body["code"] == "chain_lost" and lost.value.body["param"] == "chain_id"
    # The client resends the full history: a new chain on a live replica.
    replica, reply = _chat(
        client, [{"role": "user", "content": "w9 w10 w11"}], extra_body={"chain_id": "doomed"}
    )
    assert replica != doomed and reply.chain_status in ("new", "not_found", None)
    assert cluster.metrics()['sparsevllm:router_requests_total{outcome="lost"}'] == 1
    # Ray Serve starts a replacement replica; the router routes to it once it runs.
    deadline = time.monotonic() + 120
    while cluster.metrics()["sparsevllm:router_replicas"] < 2:
        assert time.monotonic() < deadline, "Ray Serve did not restart the replica"
        time.sleep(1.0)


@CLUSTER
def test_the_server_shuts_down_cleanly(cluster):
    launcher.shutdown()
    cluster.stopped = True
    assert not ray.is_initialized()
    with pytest.raises(httpx.TransportError):
        httpx.get(cluster.url + "/health", timeout=5)


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", "serve", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_serve_help_documents_the_replica_flags():
    out = _serve("--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--replicas", "--ray-address", "--route-max-imbalance", "--replica-cpus"):
        assert flag in out.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--replicas", "0"], "--replicas must be >= 1"),
        (["--replicas", "2", "--replica-cpus", "0"], "--replica-cpus must be > 0"),
        (["--replicas", "2", "--route-max-imbalance", "-1"], "--route-max-imbalance must be >= 0"),
        (["--replicas", "2", "--ray-address", "nonsense"], "is not HOST:PORT"),
    ],
)
def test_bad_replica_flags_are_usage_errors(tiny_path, args, message):
    out = _serve("--model", tiny_path, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_an_unreachable_ray_address_fails_fast(tiny_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    out = _serve("--model", tiny_path, "--replicas", "2", "--ray-address", f"127.0.0.1:{port}")
    assert out.returncode == 2, out.stderr
    assert f"cannot reach the Ray cluster at --ray-address 127.0.0.1:{port}" in out.stderr
    assert time.monotonic() - start < 30
