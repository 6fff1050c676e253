"""`build_app(options)`: the Ray Serve application of a replicated server, the Python
entry point of `sparsevllm serve --replicas N`.

    from ray import serve
    from sparsevllm.server.replicas.application import build_app
    serve.run(build_app(options), name=options.app_name, route_prefix="/")

Two deployments: `EngineReplica` (`options.replicas` engines, each with its CPUs and
GPUs, routed by `AffinityRouter`) and `Ingress` (the FastAPI app that relays to them;
no resources of its own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.config import RequestRouterConfig

from sparsevllm.server.replicas.engine_replica import EngineReplica
from sparsevllm.server.replicas.ingress import make_ingress_app
from sparsevllm.server.replicas.options import ReplicaOptions
from sparsevllm.server.replicas.ray_router import ROUTER_CLASS_PATH

# Calls one replica accepts at once: the engine queues them (and refuses beyond its
# --max-queue-len with 429), so Serve never has to hold requests back itself.
_HEADROOM = 64


@serve.ingress()
class Ingress:
    """The ingress deployment: relays to the engine replicas (ingress.py)."""

    def __init__(self, engine: Any, options: ReplicaOptions) -> None:
        self.engine = engine
        self.options = options

    def __serve_build_asgi_app__(self) -> FastAPI:
        return make_ingress_app(self.engine, self.options)


def router_config(options: ReplicaOptions) -> RequestRouterConfig:
    """The engine deployment's router: AffinityRouter over the shared policy."""
    kwargs = {"policy_name": options.policy_name, **dataclasses.asdict(options.route)}
    return RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH, request_router_kwargs=kwargs)


def build_app(options: ReplicaOptions) -> Any:
    """The Serve application (bind-ed deployments) for `serve.run`."""
    engine = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=options.server.max_queue_len + _HEADROOM,
        request_router_config=router_config(options),
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=10.0,
    )
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,
    )
    return ingress.bind(engine.bind(options), options)
