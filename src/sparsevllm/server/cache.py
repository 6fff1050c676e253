"""GET /v1/cache and POST /v1/cache/prune: the cross-request state (radix prefix cache or
chain cache).

Both run on the engine's worker thread (through `AsyncEngine.call`), between steps, so
they never touch structures the worker is changing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, model_validator

from sparsevllm.engine.chain_cache import ChainBusyError
from sparsevllm.engine.prune import CacheEntryNotFound
from sparsevllm.server.errors import APIError, bad_request, from_value_error
from sparsevllm.server.protocol import StrictModel, check_chain_id
from sparsevllm.server.requests import EngineClosed

if TYPE_CHECKING:
    from sparsevllm.server.serving import ServingContext

logger = logging.getLogger(__name__)


def cache_listing(engine: Any) -> dict[str, Any]:
    """`{"mode", "chains", "prefixes", "kv_slots_cached"}`, plus `"offloaded"` (radix
    nodes in a tier) and `"offload"` (bytes, counters) with offload tiers; runs on the
    worker."""
    prefix_cache = getattr(engine, "prefix_cache", None)
    chains = getattr(engine, "chains", None)
    listing: dict[str, Any] = {"mode": "off", "chains": [], "prefixes": [], "kv_slots_cached": 0}
    if prefix_cache is not None:
        entries = sorted(prefix_cache.entries(), reverse=True)
        listing["mode"] = "radix"
        listing["prefixes"] = [
            # "tokens" is the name of the logical length before pruning existed.
            {"tokens": t, "logical_tokens": t, "resident_slots": r}
            for t, r in entries
        ]
        listing["kv_slots_cached"] = int(prefix_cache.num_cached_slots)
    elif chains is not None:
        listing["mode"] = "chain"
        listing["chains"] = [dict(c) for c in chains.listing()]
        listing["kv_slots_cached"] = int(chains.reclaimable_slots)
    tiers = getattr(engine, "tiers", None)
    if tiers is not None:
        listing["offload"] = {
            "cpu_bytes": tiers.cpu.used_bytes if tiers.cpu else 0,
            "cpu_capacity_bytes": tiers.cpu.capacity_bytes if tiers.cpu else 0,
            "disk_bytes": tiers.disk.used_bytes if tiers.disk else 0,
            "disk_capacity_bytes": tiers.disk.capacity_bytes if tiers.disk else 0,
            "num_offloaded": int(tiers.num_offloaded),
            "num_restored": int(tiers.num_restored),
        }
        if prefix_cache is not None:
            listing["offloaded"] = tiers.listing()
    return listing


def persist_chains(engine: Any) -> None:
    """The worker's last act: write idle chains or unlocked radix nodes to the disk tier
    (if the engine has one)."""
    persist = getattr(engine, "persist_chains", None)  # test fakes may lack it
    if persist is None:
        return
    try:
        written = persist()
    except Exception:
        logger.exception("could not write the cached state to the disk tier")
        return
    if written:
        logger.info("wrote %d cache entries (chains or radix nodes) to the disk tier", written)


class CachePruneRequest(StrictModel):
    """Body of POST /v1/cache/prune: which history (a chain, or the cached prefix of a
    prompt), which token ranges, how to score them and how much of each to keep."""

    chain_id: str | None = None
    prompt: str | Annotated[list[int], Field(min_length=1)] | None = None
    ranges: list[Annotated[list[int], Field(min_length=2, max_length=2)]] = Field(min_length=1)
    method: str = "knorm"
    keep_ratio: float = Field(gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_target(self) -> CachePruneRequest:
        if (self.chain_id is None) == (self.prompt is None):
            raise ValueError("chain_id or prompt: give exactly one of them")
        if self.chain_id is not None:
            check_chain_id(self.chain_id, "chain_id")
        return self


async def prune_cache(ctx: ServingContext, body: CachePruneRequest) -> dict[str, Any]:
    """Run the prune on the worker; engine refusals become 400 / 404 / 409."""
    tokens = None
    if isinstance(body.prompt, str):
        tokens = await ctx.tokenize(body.prompt, "prompt")
        if not tokens:
            raise bad_request("prompt is empty", param="prompt")
    elif body.prompt is not None:
        tokens = list(body.prompt)

    def run(engine: Any) -> Any:
        return engine.prune(
            body.chain_id,
            tokens,
            ranges=[tuple(r) for r in body.ranges],
            method=body.method,
            keep_ratio=body.keep_ratio,
        )

    try:
        result = await ctx.engine.call(run)
    except CacheEntryNotFound as e:
        raise APIError(404, str(e), type="not_found_error", code="cache_entry_not_found") from None
    except ChainBusyError as e:
        raise APIError(409, str(e), type="conflict", code="cache_busy") from None
    except ValueError as e:
        raise from_value_error(e, default_param="ranges") from None
    except EngineClosed as e:
        raise APIError(503, str(e), type="service_unavailable") from None
    return {"object": "cache.prune", **result.to_dict()}
