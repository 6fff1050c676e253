"""Token-slot pool: allocation, release, per-group views, counters."""

from __future__ import annotations

import pytest

from sparsevllm.engine.kv_pool import KVPool, PoolExhausted


def test_append_release_and_counters():
    pool = KVPool(10, 4, [[0, 1, 2, 3]])
    new = pool.append(1, 4)
    assert new == [[0, 1, 2, 3]]
    pool.append(2, 3)
    assert pool.num_used == 7 and pool.num_free == 3
    assert pool.table(2) == [4, 5, 6]
    pool.release(1)
    assert pool.num_free == 7 and pool.peak_used == 7
    again = pool.append(3, 5)[0]
    assert set(again) <= set(range(10)) and not set(again) & set(pool.table(2))
    with pytest.raises(PoolExhausted):
        pool.append(4, 3)
    assert not pool.has(4)  # a failed append leaves nothing behind


def test_per_layer_groups_evict_independently():
    pool = KVPool(8, 2, [[0], [1]])
    pool.append(7, 6)
    dropped = pool.replace_view(7, 1, keep=[0, 4, 5])
    assert len(dropped) == 3
    assert pool.used_per_layer() == [6, 3]
    assert pool.num_free == 2  # the fuller layer bounds what a new token can get
    assert pool.table(7, 1) == [pool.table(7, 0)[i] for i in (0, 4, 5)]
    pool.release(7)
    assert pool.used_per_layer() == [0, 0]


def test_groups_must_cover_layers():
    with pytest.raises(ValueError, match="must cover"):
        KVPool(8, 3, [[0, 1]])


def test_shuffled_slot_order_is_a_seeded_permutation():
    from sparsevllm.engine.kv_pool import shuffle_seed

    assert shuffle_seed("sequential", 3) is None and shuffle_seed("shuffled", 3) == 3
    views = []
    for seed in (7, 7, 8):
        pool = KVPool(64, 2, [[0], [1]], shuffle_seed=seed)
        pool.append(1, 40)
        pool.append(2, 24)
        views.append(pool.table(1) + pool.table(2))
        assert sorted(pool.table(1) + pool.table(2)) == list(range(64))
        assert pool.num_free == 0
    assert views[0] == views[1] != views[2]  # deterministic per seed
    assert views[0] != list(range(64))  # not the sequential order
