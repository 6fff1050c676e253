"""The scheduler, the KV pool, the device slot tables and the radix store with its tiers,
driven by random add / step / abort / evict / make_room / prune / persist sequences
(bounded slice; the long run is scripts/state_machines.py). The invariants are listed in
tests/scheduler_machine.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from scheduler_machine import machine_class

SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.mark.parametrize(
    "store,tiers", [(None, "none"), ("radix", "none"), ("radix", "cpu"), ("radix", "cpu+disk")]
)
def test_scheduler_pool_and_store_invariants(store: str | None, tiers: str) -> None:
    run_state_machine_as_test(machine_class(store, tiers), settings=SETTINGS)
