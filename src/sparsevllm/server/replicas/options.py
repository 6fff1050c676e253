"""What a replicated server is made of: the engine, the HTTP front and the routing knobs.

Plain dataclasses (no Ray), so that the CLI can check them before Ray starts and the
deployments receive them pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparsevllm.config import EngineConfig
from sparsevllm.server.defaults import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_PORT,
)

# Imbalance (requests in flight above the least loaded replica) a holder of a request's
# chain or prefix may have and still get it.
DEFAULT_MAX_IMBALANCE = 8
# A prompt prefix counts as held when the holder has at least this share of its blocks.
DEFAULT_MIN_PREFIX_FRACTION = 0.3
# Routing keys (chains, prefix blocks) remembered; the least recently used go first.
DEFAULT_ROUTE_CAPACITY = 100_000
DEFAULT_REPLICA_CPUS = 1.0
# Ray Serve's name of the application (`serve status`, the dashboard).
DEFAULT_APP_NAME = "sparsevllm"


@dataclass(frozen=True)
class RouteOptions:
    """Knobs of the routing policy (server/replicas/policy.py).

    `max_imbalance`: how many more requests in flight than the least loaded replica a
    holder may have and still be chosen; `min_prefix_fraction`: the share of a prompt's
    prefix blocks a replica must hold to count as holding it; `capacity`: routing keys
    remembered (least recently used dropped first); `random`: route at random (the
    benchmark's baseline; no affinity at all).
    """

    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    min_prefix_fraction: float = DEFAULT_MIN_PREFIX_FRACTION
    capacity: int = DEFAULT_ROUTE_CAPACITY
    random: bool = False

    def __post_init__(self) -> None:
        if self.max_imbalance < 0:
            raise ValueError(f"--route-max-imbalance must be >= 0, got {self.max_imbalance}")
        if not 0.0 < self.min_prefix_fraction <= 1.0:
            raise ValueError(
                f"min_prefix_fraction must be in (0, 1], got {self.min_prefix_fraction}"
            )
        if self.capacity < 1:
            raise ValueError(f"the routing capacity must be >= 1, got {self.capacity}")


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP side of every replica's app, as `sparsevllm serve` takes it."""

    served_model_name: str
    api_key: str | None = None
    max_queue_len: int = DEFAULT_MAX_QUEUE_LEN
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT


@dataclass(frozen=True)
class ReplicaOptions:
    """A replicated server: `replicas` engines of `engine`, each with `replica_cpus` CPUs
    and `replica_gpus` GPUs of the Ray cluster, behind one ingress."""

    engine: EngineConfig
    server: ServerOptions
    replicas: int = 2
    replica_cpus: float = DEFAULT_REPLICA_CPUS
    replica_gpus: float = 0.0
    route: RouteOptions = field(default_factory=RouteOptions)
    app_name: str = DEFAULT_APP_NAME
    # Seconds between Ray Serve's health checks of a replica (a dead one is noticed
    # at once by its calls; this bounds how long a hung one keeps requests).
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.replica_gpus < 0:
            raise ValueError(f"replica_gpus must be >= 0, got {self.replica_gpus}")

    @property
    def policy_name(self) -> str:
        """The key under which the ingress and the router share one routing policy."""
        return f"{self.app_name}/EngineReplica"
