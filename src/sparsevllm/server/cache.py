"""GET /v1/cache: the cross-request state (radix prefix cache or chain cache).

The listing is built by `cache_listing` on the engine's worker thread (through
`AsyncEngine.call`), between steps, so it never reads structures the worker is changing.
"""

from __future__ import annotations

from typing import Any


def cache_listing(engine: Any) -> dict[str, Any]:
    """`{"mode", "chains", "prefixes", "kv_slots_cached"}`; runs on the worker thread."""
    prefix_cache = getattr(engine, "prefix_cache", None)
    chains = getattr(engine, "chains", None)
    listing: dict[str, Any] = {"mode": "off", "chains": [], "prefixes": [], "kv_slots_cached": 0}
    if prefix_cache is not None:
        entries = sorted(prefix_cache.entries(), reverse=True)
        listing["mode"] = "radix"
        listing["prefixes"] = [{"tokens": t, "resident_slots": r} for t, r in entries]
        listing["kv_slots_cached"] = int(prefix_cache.num_cached_slots)
    elif chains is not None:
        listing["mode"] = "chain"
        listing["chains"] = [dict(c) for c in chains.listing()]
        listing["kv_slots_cached"] = int(chains.reclaimable_slots)
    return listing
