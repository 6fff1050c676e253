"""The Serve deployment of one engine: an AsyncEngine and the project's FastAPI app.

Each replica loads its own engine with the server's usual flags and serves relayed
requests through its own app (bridge.py), so every endpoint, error and stream is the
single server's. Its response ids carry its replica id (`resp_<replica>_...`, see
policy.py) so that `previous_response_id` finds it again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray import serve

from sparsevllm.server.app import build_app as build_server_app
from sparsevllm.server.async_engine import AsyncEngine
from sparsevllm.server.replicas.bridge import RelayedRequest, ResponseHead, call_asgi
from sparsevllm.server.replicas.keys import RouteHint
from sparsevllm.server.replicas.options import ReplicaOptions
from sparsevllm.server.replicas.policy import response_id_prefix

logger = logging.getLogger(__name__)

# Seconds running requests get to finish when Serve stops a replica.
_STOP_GRACE_S = 5.0


class EngineReplica:
    """One engine behind the router (a Ray Serve deployment class)."""

    def __init__(self, options: ReplicaOptions) -> None:
        from sparsevllm.engine.engine import LLMEngine

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.options = options
        server = options.server
        self.engine = AsyncEngine(LLMEngine(options.engine))
        self.app = build_server_app(
            self.engine,
            server.served_model_name,
            api_key=server.api_key,
            max_queue_len=server.max_queue_len,
            max_body_bytes=server.max_body_bytes,
            max_stored_responses=server.max_stored_responses,
            reasoning_parser=server.reasoning_parser,
            tool_call_parser=server.tool_call_parser,
            response_id_prefix=response_id_prefix(self.replica_id),
        )
        self.engine.start()
        logger.info("replica %s serves %s", self.replica_id, server.served_model_name)

    async def relay(
        self, hint: RouteHint, request: RelayedRequest
    ) -> AsyncIterator[ResponseHead | bytes]:
        """Serve one relayed request (`hint` is the router's; unused here)."""
        async for part in call_asgi(self.app, request, self.replica_id):
            yield part

    async def metrics(self, hint: RouteHint) -> tuple[str, str]:
        """(replica id, this engine's Prometheus exposition)."""
        text = self.engine.metrics.render(
            self.engine.stats(), self.options.server.served_model_name
        )
        return self.replica_id, text

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine worker died is restarted."""
        if not self.engine.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine worker is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(_STOP_GRACE_S)
