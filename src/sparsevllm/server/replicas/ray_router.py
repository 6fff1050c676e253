"""The Ray Serve request router of the engine replicas: it asks the routing policy.

Ray Serve runs one router per deployment handle, in the process that holds the handle
(here, the ingress replica). The router finds the call's `RouteHint` among its
arguments, ranks the running replicas with the process's shared `RoutingPolicy`
(policy.py), and keeps the policy's view of the replicas and their load current: the
load of a call is held from its routing to Ray's completion callback.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from sparsevllm.server.replicas.keys import RouteHint
from sparsevllm.server.replicas.options import RouteOptions
from sparsevllm.server.replicas.policy import RoutingPolicy, shared_policy

ROUTER_CLASS_PATH = "sparsevllm.server.replicas.ray_router.AffinityRouter"


def hint_of(pending_request: PendingRequest | None) -> RouteHint:
    """The call's RouteHint (its first RouteHint argument; an empty one if none)."""
    if pending_request is not None:
        for arg in pending_request.args:
            if isinstance(arg, RouteHint):
                return arg
    return RouteHint()


class AffinityRouter(RequestRouter):
    """Chain-, response- and prefix-affine routing with bounded imbalance (policy.py);
    configured by `request_router_kwargs`: `policy_name` and the RouteOptions fields."""

    policy: RoutingPolicy

    def initialize_state(self, **kwargs: Any) -> None:
        name = str(kwargs.pop("policy_name", "default"))
        self.policy = shared_policy(name, RouteOptions(**kwargs))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.mark_dead(replica_id.unique_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank per replica, the policy's choice first; the choice is booked at
        once, so that calls routed together see each other's load."""
        hint = hint_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = self.policy.choose(hint, list(by_id))
        if ranked and pending_request is not None:
            key = pending_request.metadata.internal_request_id
            hint.meta["request_key"] = key
            self.policy.routed(hint, ranked[0], key)
        return [[by_id[r]] for r in ranked if r in by_id]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        key = pending_request.metadata.internal_request_id
        self.policy.routed(hint_of(pending_request), replica_id.unique_id, key)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(internal_request_id)
