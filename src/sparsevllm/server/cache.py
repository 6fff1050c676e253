"""GET /v1/cache and POST /v1/cache/prune: the cross-request state (radix prefix cache or
chain cache).

Both run on the engine's worker thread (through `AsyncEngine.call`), between steps, so
they never touch structures the worker is changing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, model_validator

from sparsevllm.engine.cache.store import (
    CacheEntryNotFound,
    CacheListing,
    ChainBusyError,
    empty_listing,
)
from sparsevllm.server.errors import APIError, bad_request, from_value_error
from sparsevllm.server.protocol import CHAIN_ID_SCHEMA, StrictModel, TokenId, check_chain_id
from sparsevllm.server.requests import EngineClosed

if TYPE_CHECKING:
    from sparsevllm.server.serving import ServingContext

logger = logging.getLogger(__name__)

TokenIndex = Annotated[int, Field(ge=0)]  # a logical token position


def cache_listing(engine: Any) -> CacheListing:
    """`{"mode", "chains", "prefixes", "kv_slots_cached"}`, plus `"offloaded"` (radix
    nodes in a tier) and `"offload"` (bytes, counters) with offload tiers; runs on the
    worker."""
    store = getattr(engine, "store", None)  # test fakes may lack it
    return store.listing() if store is not None else empty_listing()


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

    chain_id: str | None = Field(None, json_schema_extra=CHAIN_ID_SCHEMA)
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | None = None
    ranges: list[Annotated[list[TokenIndex], Field(min_length=2, max_length=2)]] = Field(
        min_length=1
    )
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
