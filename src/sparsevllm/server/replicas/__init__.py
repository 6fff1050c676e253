"""Engine replicas behind one router on Ray Serve: `sparsevllm serve --replicas N`.

One responsibility per module (see docs/deployment.md):

- `options`: what a replicated server is made of (`ReplicaOptions`, `RouteOptions`);
- `keys`: the routing keys of a request (chain id, previous response id, prompt-prefix
  block hashes), read from its body without a tokenizer;
- `policy`: the routing policy, pure Python (affinity with bounded imbalance, least
  loaded otherwise, soft state, hit/miss counters);
- `ray_router`: the Ray Serve request router that asks the policy;
- `bridge`: one HTTP request through an ASGI app in-process, as a stream of parts;
- `engine_replica`: the Serve deployment of one engine and the project's FastAPI app;
- `relay`: the ingress side of a call: retries, failover, the `chain_lost` error;
- `ingress`: the FastAPI ingress app (forwarding, /metrics, /health);
- `application`: `build_app(...)`, the Python entry point that builds the Serve app;
- `launcher`: starting or joining Ray, resource checks, `run_replicated_server`.

Only this package imports Ray (an import-linter contract of pyproject.toml); Ray is the
optional `replicas` extra.
"""
