"""The failure contract of the ingress (server/replicas/relay.py) against a fake Serve
handle: retries while nothing was sent, `chain_lost`, the error event of a broken
stream, 503 when every attempt fails. No Ray cluster (Ray's exception types only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402

from sparsevllm.server.errors import APIError  # noqa: E402
from sparsevllm.server.replicas.bridge import RelayedRequest, ResponseHead  # noqa: E402
from sparsevllm.server.replicas.keys import RouteHint  # noqa: E402
from sparsevllm.server.replicas.policy import RoutingPolicy  # noqa: E402
from sparsevllm.server.replicas.relay import ReplicaClient  # noqa: E402

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]


class FakeHandle:
    """`handle.options(stream=True).relay.remote(hint, request)`: each call routed by
    the policy (as AffinityRouter does) and served by `script[replica]`, a list of parts
    where an exception is raised when reached."""

    def __init__(self, policy: RoutingPolicy, script: dict[str, list[Any]]) -> None:
        self.policy, self.script, self.calls = policy, script, []
        self.relay = self

    def options(self, **kwargs: Any) -> FakeHandle:
        return self

    def remote(self, hint: RouteHint, request: RelayedRequest) -> AsyncIterator[Any]:
        replica = self.policy.choose(hint, list(self.script))[0]
        self.policy.routed(hint, replica, f"call{len(self.calls)}")
        hint.meta["request_key"] = f"call{len(self.calls)}"
        self.calls.append(replica)
        return self._parts(replica)

    async def _parts(self, replica: str) -> AsyncIterator[Any]:
        for part in self.script[replica]:
            if isinstance(part, BaseException):
                raise part
            yield part


def client(script: dict[str, list[Any]]) -> tuple[ReplicaClient, FakeHandle]:
    policy = RoutingPolicy(seed=0)
    policy.set_replicas(script)
    handle = FakeHandle(policy, script)
    return ReplicaClient(handle, policy), handle


def ok(replica: str, headers: list[tuple[bytes, bytes]] = JSON) -> list[Any]:
    return [ResponseHead(200, headers, replica), b'{"ok": ', b"true}"]


REQUEST = RelayedRequest("POST", "/v1/completions")


def test_a_request_whose_replica_dies_before_answering_is_retried_elsewhere():
    relay, handle = client({"a": [ActorDiedError()], "b": ok("b")})
    hint = RouteHint()
    handle.policy.routed(RouteHint(), "b", "busy")  # b is busier: a is chosen first
    outcome = asyncio.run(relay.call(REQUEST, hint))
    assert outcome.head.replica == "b" and outcome.body == b'{"ok": true}'
    assert handle.calls == ["a", "b"] and handle.policy.is_dead("a")
    assert handle.policy.load("a") == 0  # the failed call's load was released


def test_a_dead_replicas_chain_is_reported_not_retried():
    relay, handle = client({"a": [ActorDiedError()], "b": ok("b")})
    handle.policy.routed(RouteHint(chain_id="c"), "a", "first")  # the chain lives on a
    handle.policy.completed("first")
    with pytest.raises(APIError) as lost:
        asyncio.run(relay.call(REQUEST, RouteHint(chain_id="c")))
    assert lost.value.status == 410 and lost.value.code == "chain_lost"
    assert lost.value.param == "chain_id" and handle.calls == ["a"]
    # Forgotten: the resent history starts a new chain on a live replica.
    assert asyncio.run(relay.call(REQUEST, RouteHint(chain_id="c"))).head.replica == "b"
    with pytest.raises(APIError) as gone:  # a stored response of the dead replica
        asyncio.run(relay.call(REQUEST, RouteHint(previous_response_id="resp_a_123")))
    assert gone.value.status == 410 and gone.value.param == "previous_response_id"


def test_a_broken_stream_ends_with_a_retriable_error_event():
    stream = [ResponseHead(200, SSE, "a"), b"data: {}\n\n", ActorDiedError()]
    relay, handle = client({"a": stream, "b": ok("b", SSE)})
    handle.policy.routed(RouteHint(), "b", "busy")
    hint = RouteHint()

    async def read() -> list[bytes]:
        outcome = await relay.call(REQUEST, hint)
        assert outcome.stream is not None
        return [chunk async for chunk in relay.relay_stream(outcome, hint)]

    chunks = asyncio.run(read())
    assert chunks[0] == b"data: {}\n\n"
    error = json.loads(chunks[1].decode()[len("data: ") :])["error"]
    assert error["code"] == "replica_failed" and error["type"] == "service_unavailable"
    assert handle.calls == ["a"]  # not retried: part of it had reached the client


def test_no_replica_left_is_a_503():
    relay, handle = client({"a": [ActorDiedError()], "b": [ActorDiedError()]})
    with pytest.raises(APIError) as unavailable:
        asyncio.run(relay.call(REQUEST, RouteHint()))
    assert unavailable.value.status == 503 and unavailable.value.code == "replica_unavailable"
    assert sorted(handle.calls[:2]) == ["a", "b"]
