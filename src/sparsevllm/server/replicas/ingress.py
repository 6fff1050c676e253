"""The ingress: a FastAPI app that relays every request to an engine replica's own app
(the project's server, endpoint for endpoint) and serves one metrics view.

`/metrics` gathers every replica's exposition, each sample labelled `replica="<id>"`,
and appends the router's counters. Every relayed response carries the header
`X-SparseVLLM-Replica` (the replica that served it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sparsevllm.server.errors import APIError
from sparsevllm.server.metrics import CONTENT_TYPE
from sparsevllm.server.replicas.bridge import RelayedRequest, ResponseHead
from sparsevllm.server.replicas.keys import (
    RouteHint,
    block_hashes,
    flatten_prompt,
    hint_for,
    reply_text,
)
from sparsevllm.server.replicas.options import ReplicaOptions
from sparsevllm.server.replicas.policy import ANY_REPLICA, OUTCOMES, RoutingPolicy, shared_policy
from sparsevllm.server.replicas.relay import (
    REPLICA_FAILURES,
    ReplicaClient,
    fresh_call_id,
    unavailable,
)

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-SparseVLLM-Replica"
_HOP_HEADERS = {b"host", b"content-length", b"transfer-encoding", b"connection"}
_METRICS_TIMEOUT_S = 10.0
_METHODS = ["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"]
_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})?\s+(.*)$")


def make_ingress_app(handle: Any, options: ReplicaOptions) -> FastAPI:
    """The ingress app over the engine deployment's `handle`."""
    policy = shared_policy(options.policy_name, options.route)
    client = ReplicaClient(handle, policy)
    # No docs routes of its own: /docs and /openapi.json are the replicas'.
    app = FastAPI(title="Sparse-vLLM replicas", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        try:
            return Response(await gather_metrics(handle, policy), media_type=CONTENT_TYPE)
        except APIError as e:
            return e.response()

    @app.api_route("/{path:path}", methods=_METHODS, response_model=None)
    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        if len(body) > options.server.max_body_bytes:
            limit = options.server.max_body_bytes
            error = APIError(
                413, f"the request body exceeds {limit} bytes", code="request_too_large"
            )
            return error.response()
        return await relay(client, request, body)

    return app


async def relay(client: ReplicaClient, request: Request, body: bytes) -> Response:
    """One request relayed to a replica (see relay.py for the failure contract)."""
    headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() not in _HOP_HEADERS]
    relayed = RelayedRequest(
        request.method, request.url.path, request.url.query.encode(), headers, body
    )
    lower = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
    hint = hint_for(request.url.path, lower, body)
    try:
        outcome = await client.call(relayed, hint)
    except APIError as e:
        return e.response()
    out_headers = _response_headers(outcome.head)
    if outcome.stream is not None:
        return StreamingResponse(
            client.relay_stream(outcome, hint),
            status_code=outcome.head.status,
            headers=out_headers,
        )
    if outcome.head.status == 200:
        learn_reply(client.policy, outcome.head.replica, request.url.path, body, outcome.body)
    return Response(outcome.body, status_code=outcome.head.status, headers=out_headers)


def _response_headers(head: ResponseHead) -> dict[str, str]:
    out = {
        k.decode("latin-1"): v.decode("latin-1")
        for k, v in head.headers
        if k.lower() not in _HOP_HEADERS
    }
    out[REPLICA_HEADER] = head.replica
    return out


def learn_reply(
    policy: RoutingPolicy, replica: str, path: str, request_body: bytes, response_body: bytes
) -> None:
    """Record the prompt and its reply as prefix blocks of `replica`: the next turn of
    the conversation starts with them."""
    try:
        request, response = json.loads(request_body), json.loads(response_body)
    except (ValueError, RecursionError):
        return
    if not isinstance(request, dict) or not isinstance(response, dict):
        return
    prompt, reply = flatten_prompt(request), reply_text(path, response)
    if prompt is not None and reply is not None:
        policy.record_prefix(replica, block_hashes(prompt + reply))


async def gather_metrics(handle: Any, policy: RoutingPolicy) -> str:
    """Every replica's metrics labelled by replica, then the router's counters."""
    replica_ids = policy.replicas()
    if not replica_ids:  # the router learns the replicas on its first call
        fresh_call_id()
        call = handle.metrics.remote(RouteHint(target=ANY_REPLICA))
        await asyncio.wait_for(call, _METRICS_TIMEOUT_S)
        replica_ids = policy.replicas()
    texts: list[tuple[str, str]] = []
    for replica_id in replica_ids:
        fresh_call_id()
        call = handle.metrics.remote(RouteHint(target=replica_id))
        try:
            texts.append(await asyncio.wait_for(call, _METRICS_TIMEOUT_S))
        except asyncio.TimeoutError:
            logger.warning("no metrics from replica %s within %g s", replica_id, _METRICS_TIMEOUT_S)
        except REPLICA_FAILURES as e:
            logger.warning("no metrics from replica %s: %r", replica_id, e)
    if not texts and replica_ids:
        raise unavailable("no replica answered for its metrics")
    return merge_expositions(texts) + router_metrics(policy)


def label_sample(line: str, replica: str) -> str:
    """A sample line with `replica="..."` as its first label."""
    match = _SAMPLE.match(line)
    if match is None:
        return line
    name, labels, value = match.groups()
    inner = f'replica="{replica}"' + (f",{labels}" if labels else "")
    return f"{name}{{{inner}}} {value}"


def merge_expositions(texts: list[tuple[str, str]]) -> str:
    """Several (replica, exposition) pairs as one exposition: each family's HELP and TYPE
    once, then its samples of every replica, labelled."""
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                meta = families.setdefault(family, [])
                if line not in meta:
                    meta.append(line)
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(label_sample(line, replica))
    out: list[str] = []
    for family in dict.fromkeys([*families, *samples]):
        out += families.get(family, []) + samples.get(family, [])
    return "\n".join(out) + "\n" if out else ""


def router_metrics(policy: RoutingPolicy) -> str:
    """The router's counters: requests by routing outcome, live replicas, keys held."""
    snap = policy.snapshot()
    name = "sparsevllm:router_requests_total"
    lines = [
        f"# HELP {name} Requests routed, by outcome: hit (to a replica holding the request's "
        "chain, response or prompt prefix), miss (no holder: least loaded), overloaded (the "
        "holder was over the imbalance bound), random (random routing), lost (410 chain_lost).",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{outcome="{o}"}} {snap[o]}' for o in OUTCOMES if o != "target"]
    lines += [
        "# HELP sparsevllm:router_replicas Engine replicas the router routes to.",
        "# TYPE sparsevllm:router_replicas gauge",
        f"sparsevllm:router_replicas {len(policy.replicas())}",
        "# HELP sparsevllm:router_keys Routing keys remembered (soft state), by kind.",
        "# TYPE sparsevllm:router_keys gauge",
        f'sparsevllm:router_keys{{kind="chain"}} {snap["chains"]}',
        f'sparsevllm:router_keys{{kind="prefix_block"}} {snap["blocks"]}',
    ]
    return "\n".join(lines) + "\n"
