"""The ingress side of a call to a replica: routing keys in, failover, `chain_lost`.

The failure contract (docs/deployment.md#failures):

- a replica that dies before a response has sent anything to the client (every
  non-streamed response, and a stream before its head) is marked dead and the call is
  retried on another replica, up to `attempts` times, unless the call continues a chain
  that lived there;
- a call whose `chain_id` last ran, or whose `previous_response_id` is stored, on a dead
  replica gets HTTP 410 with code `chain_lost`: resend the conversation's full history
  (without `previous_response_id`); the chain starts again on a live replica;
- a stream already under way ends with an error event (code `replica_failed`, or
  `chain_lost`); the client retries it;
- when no replica is left to try: 503 with code `replica_unavailable` (retriable).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from sparsevllm.server.errors import APIError
from sparsevllm.server.replicas.bridge import RelayedRequest, ResponseHead
from sparsevllm.server.replicas.keys import RouteHint
from sparsevllm.server.replicas.policy import RoutingPolicy

logger = logging.getLogger(__name__)

# What a call raises when its replica died or cannot be reached.
REPLICA_FAILURES: tuple[type[BaseException], ...] = (
    RayActorError,
    ReplicaUnavailableError,
    DeploymentUnavailableError,
)
DEFAULT_ATTEMPTS = 3


def fresh_call_id() -> None:
    """Give the next handle call of this task its own Serve internal request id.

    Serve stamps every handle call made while serving an HTTP request with that
    request's internal id, and its router matches a routed replica to the pending call
    by that id: two calls of one request (retries, per-replica metrics) would be
    confused, one of them never routed. A fresh id per call keeps them apart (and is
    the key under which the policy holds the call's load).
    """
    from ray.serve.context import _set_request_context  # no public way to do this

    _set_request_context(_internal_request_id=uuid.uuid4().hex)


def chain_lost(param: str, key: str) -> APIError:
    """410 `chain_lost`: the replica that held this conversation is gone."""
    what = "chain" if param == "chain_id" else "stored response"
    return APIError(
        410,
        f"the {what} {key!r} lived on a replica that failed; resend the conversation's "
        f"full history (without previous_response_id): it starts again on another replica",
        type="chain_lost",
        param=param,
        code="chain_lost",
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="replica_unavailable")


def is_event_stream(head: ResponseHead) -> bool:
    return (head.header("content-type") or "").startswith("text/event-stream")


@dataclass
class Outcome:
    """A replica's answer: its head and either its whole body or its open stream."""

    head: ResponseHead
    body: bytes = b""
    stream: Any = None  # the rest of a streamed response (a Serve response generator)


class ReplicaClient:
    """Calls the engine replicas through a Serve handle (its router asks `policy`)."""

    def __init__(self, handle: Any, policy: RoutingPolicy, attempts: int = DEFAULT_ATTEMPTS):
        self.handle = handle
        self.policy = policy
        self.attempts = attempts

    def check_lost(self, hint: RouteHint) -> None:
        """Raise 410 `chain_lost` if the call continues a chain of a dead replica."""
        lost = self.policy.lost_key(hint)
        if lost is not None:
            self.policy.count_lost()
            if lost[0] == "chain_id":
                self.policy.forget_chain(lost[1])  # its resend starts a new chain
            raise chain_lost(*lost)

    def failed(self, hint: RouteHint, error: BaseException) -> None:
        """The call's replica failed: mark it dead, keep the retry away from it, and
        raise `chain_lost` if the call's chain lived there."""
        dead = hint.chosen
        logger.warning("replica %s failed a call: %s", dead, type(error).__name__)
        if dead is not None:
            self.policy.mark_dead(dead)
            hint.exclude = hint.exclude | {dead}
        self.done(hint)
        self.check_lost(hint)

    def done(self, hint: RouteHint) -> None:
        key = hint.meta.get("request_key")
        if key is not None:
            self.policy.completed(key)

    async def call(self, request: RelayedRequest, hint: RouteHint) -> Outcome:
        """The response to `request`, retried on another replica while nothing of it
        has reached the client."""
        for attempt in range(self.attempts):
            self.check_lost(hint)
            hint.chosen, hint.meta = None, {}
            fresh_call_id()
            stream = self.handle.options(stream=True).relay.remote(hint, request)
            try:
                head = await stream.__anext__()
                if is_event_stream(head):
                    return Outcome(head, stream=stream)
                body = b"".join([chunk async for chunk in stream])
            except REPLICA_FAILURES as e:
                self.failed(hint, e)
                await asyncio.sleep(0.2 * attempt)
                continue
            except StopAsyncIteration:
                raise unavailable("the replica closed the call without a response") from None
            self.done(hint)
            return Outcome(head, body)
        raise unavailable(f"no replica could serve the request after {self.attempts} attempts")

    async def relay_stream(self, outcome: Outcome, hint: RouteHint) -> AsyncIterator[bytes]:
        """The rest of a streamed response; a replica failure ends it with an error
        event (the client retries)."""
        try:
            async for chunk in outcome.stream:
                yield chunk
        except REPLICA_FAILURES as e:
            try:
                self.failed(hint, e)
                error = APIError(
                    503,
                    "the replica serving this stream failed; retry the request",
                    type="service_unavailable",
                    code="replica_failed",
                )
            except APIError as lost:
                error = lost
            yield f"data: {json.dumps(error.body())}\n\n".encode()
        finally:
            self.done(hint)
