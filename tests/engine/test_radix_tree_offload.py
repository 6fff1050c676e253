"""RadixTree with an offload tier: which nodes go, how they come back, what is dropped.

Pure Python: a fake tier keeps each offloaded node's slot ids and restores it into new
ones (the engine tests check the KV itself: test_radix_offload.py).
"""

from __future__ import annotations

from sparsevllm.engine.cache.radix_tree import RadixTree


class FakeTier:
    def __init__(self, capacity: int = 100) -> None:
        self.capacity = capacity  # entries
        self.store: dict[int, list[int]] = {}
        self.room = True  # whether the pool can take a restored node
        self.next_slot = 100
        self.dropped: list[int] = []

    def offload(self, node):
        if len(self.store) >= self.capacity:
            return None
        self.store[node.key] = list(node.slots)
        return "CPU"

    def restore(self, node, reserve):
        if not self.room:
            return None
        n = len(self.store.pop(node.key))
        self.next_slot += n
        return list(range(self.next_slot - n, self.next_slot))

    def drop(self, node):
        if self.store.pop(node.key, None) is not None:
            self.dropped.append(node.key)


def tree(tier: FakeTier) -> RadixTree:
    """[1, 2] -> {[3, 4], [5]}, [7, 8]; [3, 4] least recently used, [7, 8] most."""
    cache = RadixTree()
    cache.tier = tier
    cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert cache.insert([1, 2, 5], [20, 21, 22]) == [20, 21]
    cache.insert([7, 8], [30, 31])
    return cache


def tiers(cache: RadixTree) -> dict[tuple[int, ...], str | None]:
    out, stack = {}, list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out[tuple(node.tokens)] = node.tier
        stack.extend(node.children.values())
    return out


def test_leaves_go_first_and_a_match_restores_them_top_down():
    tier = FakeTier()
    cache = tree(tier)
    assert cache.evict(1) == [12, 13]  # the LRU leaf; the node stays in the tree
    assert tiers(cache)[(3, 4)] == "CPU" and cache.num_cached_slots == 5
    # [1, 2] goes only after both its children: the resident nodes stay a top subtree.
    assert cache.evict(3) == [22, 10, 11]
    assert tiers(cache) == {(1, 2): "CPU", (3, 4): "CPU", (5,): "CPU", (7, 8): None}
    assert cache.num_cached_slots == cache.num_evictable_slots == 2
    slots, node = cache.match([1, 2, 3, 4, 9])
    assert slots == [100, 101, 102, 103] and cache.depth(node) == 4
    assert tiers(cache)[(1, 2)] is None and tiers(cache)[(5,)] == "CPU"
    assert cache.num_cached_slots == cache.num_evictable_slots == 6


def test_locked_nodes_stay_and_a_partial_match_restores_then_splits():
    tier = FakeTier()
    cache = tree(tier)
    _, node = cache.match([7, 8])
    cache.lock(node)
    cache.evict(100)
    assert tiers(cache)[(7, 8)] is None and cache.num_evictable_slots == 0
    cache.unlock(node)
    slots, node = cache.match([1, 2, 3, 6])  # ends inside the offloaded [3, 4]
    assert slots == [100, 101, 102] and cache.depth(node) == 3
    assert tiers(cache)[(4,)] is None  # the lower half of the restored node stays cached
    assert cache.match([1, 2, 3, 4])[0] == [100, 101, 102, 103]


def test_no_room_to_restore_stops_the_match_before_the_node():
    tier = FakeTier()
    cache = tree(tier)
    cache.evict(2)  # [3, 4] and [5]
    tier.room = False
    slots, node = cache.match([1, 2, 3, 4])
    assert slots == [10, 11] and cache.depth(node) == 2
    assert tiers(cache)[(3, 4)] == "CPU"


def test_a_node_the_tier_refuses_leaves_with_its_offloaded_subtree():
    tier = FakeTier(capacity=2)
    cache = tree(tier)
    # [3, 4] and [5] fit; [1, 2] does not: it leaves, and its offloaded children too.
    freed = cache.evict(5)
    assert sorted(freed) == [10, 11, 12, 13, 22]
    assert tiers(cache) == {(7, 8): None}
    assert tier.store == {} and len(tier.dropped) == 2
    assert cache.num_cached_slots == 2


def test_a_request_that_computed_an_offloaded_node_replaces_it():
    tier = FakeTier()
    cache = tree(tier)
    cache.evict(100)
    # Covering [1, 2] whole: the request's copy takes over; [3, 4] and [5] stay offloaded.
    assert cache.insert([1, 2], [40, 41]) == []
    assert tiers(cache)[(1, 2)] is None and tiers(cache)[(3, 4)] == "CPU"
    assert cache.num_cached_slots == 2  # [7, 8] is offloaded too
    # Branching inside the offloaded [3, 4]: it is dropped and a new leaf takes its place.
    assert cache.insert([1, 2, 3, 9], [40, 41, 42, 43]) == []
    assert (3, 4) not in tiers(cache) and tiers(cache)[(3, 9)] is None
    assert cache.match([1, 2, 3, 9])[0] == [40, 41, 42, 43]


def test_discard_removes_a_node_once():
    tier = FakeTier()
    cache = tree(tier)
    cache.evict(100)
    parent = cache.root.children[1]
    child = parent.children[3]
    cache.discard(parent)
    assert tiers(cache) == {(7, 8): "CPU"}
    cache.discard(child)  # already gone with its parent: nothing happens
    assert tiers(cache) == {(7, 8): "CPU"} and cache.num_cached_slots == 0
