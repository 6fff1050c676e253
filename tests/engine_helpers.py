"""Helpers shared by the engine tests: drive one request to its end."""

from __future__ import annotations

from typing import Any

from sparsevllm import SamplingParams


def run_request(
    engine: Any, prompt: list[int], params: SamplingParams, chain_id: str | None = None
) -> tuple[Any, int]:
    """Step the engine until the request ends: (its final output, tokens it prefilled)."""
    before = engine.stats()["num_prefill_tokens_computed"]
    rid = engine.add_request(prompt, params, chain_id=chain_id)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    return out, engine.stats()["num_prefill_tokens_computed"] - before
