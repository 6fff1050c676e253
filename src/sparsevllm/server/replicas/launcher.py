"""Running a replicated server: join (or start) Ray, check its resources, deploy the
Serve application on HOST:PORT, serve until SIGINT/SIGTERM, then shut down cleanly.

Input errors fail before anything is deployed: an unreachable `--ray-address` within
`CONNECT_TIMEOUT_S` (a TCP probe of the address; Ray's own connect would retry for a
minute), and `--replicas` beyond the cluster's CPUs or GPUs, naming both.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType

from sparsevllm.server.replicas.options import ReplicaOptions

logger = logging.getLogger("sparsevllm.server")

CONNECT_TIMEOUT_S = 5.0
_LOCAL_ADDRESSES = ("auto", "local")


class ReplicaSetupError(ValueError):
    """The cluster cannot run what was asked (the CLI reports it with exit status 2)."""


def probe_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast unless `address` (HOST:PORT or ray://HOST:PORT) accepts connections."""
    if address in _LOCAL_ADDRESSES:
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ReplicaSetupError(
            f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT or auto"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ReplicaSetupError(
            f"cannot reach the Ray cluster at --ray-address {address} within {timeout_s:g} s "
            f"({e}); start it with `ray start --head` or check the address"
        ) from None


def replica_gpus(device: str, cluster_gpus: float) -> float:
    """GPUs one replica takes: 1 on CUDA (auto: when the cluster has GPUs), else 0."""
    if device == "cpu":
        return 0.0
    if device == "auto":
        return 1.0 if cluster_gpus > 0 else 0.0
    return 1.0


def check_resources(options: ReplicaOptions, resources: dict[str, float]) -> None:
    """Raise, naming what is needed and what the cluster has, when the replicas do not
    fit in the cluster's CPUs and GPUs."""
    n = options.replicas
    need_cpus, need_gpus = n * options.replica_cpus, n * options.replica_gpus
    have_cpus, have_gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if need_cpus <= have_cpus and need_gpus <= have_gpus:
        return
    raise ReplicaSetupError(
        f"--replicas {n} needs {need_cpus:g} CPUs and {need_gpus:g} GPUs "
        f"({options.replica_cpus:g} CPUs, --replica-cpus, and {options.replica_gpus:g} GPUs "
        f"per replica), but the Ray cluster has {have_cpus:g} CPUs and {have_gpus:g} GPUs; "
        f"lower --replicas or --replica-cpus, or add nodes (ray start --address ...)"
    )


def connect(address: str | None, num_cpus: float | None = None) -> dict[str, float]:
    """Join the cluster at `address` (None: start a local Ray); its total resources."""
    import ray

    if address is not None:
        probe_address(address)
    try:
        if address is None:
            cpus = None if num_cpus is None else int(num_cpus)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise ReplicaSetupError(f"cannot join the Ray cluster at {address!r}: {e}") from None
    return {k: float(v) for k, v in ray.cluster_resources().items()}


def deploy(options: ReplicaOptions, resources: dict[str, float]) -> ReplicaOptions:
    """Check the resources and run the Serve application on the options' host:port
    (returns the options with the GPUs per replica filled in)."""
    import dataclasses

    from ray import serve

    from sparsevllm.server.replicas.application import build_app

    gpus = replica_gpus(options.engine.device, resources.get("GPU", 0.0))
    options = dataclasses.replace(options, replica_gpus=gpus)
    check_resources(options, resources)
    host, port = options.server.host, options.server.port
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options), name=options.app_name, route_prefix="/")
    logger.info("serving %d replicas on http://%s:%d", options.replicas, host, port)
    return options


def undeploy(options: ReplicaOptions) -> None:
    """Delete the Serve application (Ray and Serve keep running: deploy again at will)."""
    from ray import serve

    serve.delete(options.app_name)


def shutdown() -> None:
    """Stop the Serve application and the Ray connection (a local Ray stops with it)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def run_replicated_server(options: ReplicaOptions, ray_address: str | None = None) -> int:
    """`sparsevllm serve --replicas N`: serve until SIGINT/SIGTERM; returns 0."""
    resources = connect(ray_address)
    try:
        deploy(options, resources)
        stop = threading.Event()

        def on_signal(sig: int, frame: FrameType | None) -> None:
            logger.info("%s: shutting down the replicas", signal.Signals(sig).name)
            stop.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        print(f"Serve running on http://{options.server.host}:{options.server.port}", flush=True)
        try:
            while not stop.wait(1.0):
                pass
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        shutdown()
    logger.info("server stopped")
    return 0
