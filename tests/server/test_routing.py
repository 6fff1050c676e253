"""The routing policy and the routing keys of server/replicas (no Ray: fast)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.server.replicas.keys import (
    BLOCK_CHARS,
    RouteHint,
    block_hashes,
    flatten_messages,
    flatten_prompt,
    hint_for,
    reply_text,
)
from sparsevllm.server.replicas.options import ReplicaOptions, RouteOptions, ServerOptions
from sparsevllm.server.replicas.policy import (
    LRU,
    RoutingPolicy,
    response_id_prefix,
    response_owner,
    shared_policy,
)

REPLICAS = ["aaa", "bbb"]


def route(policy: RoutingPolicy, hint: RouteHint, key: str, done: bool = True) -> str:
    """Choose, route to the first choice, and (if `done`) complete."""
    chosen = policy.choose(hint, REPLICAS)[0]
    policy.routed(hint, chosen, key)
    if done:
        policy.completed(key)
    return chosen


def chat(messages: list[dict[str, str]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_block_hashes_are_chained_and_skip_the_partial_tail():
    text = "x" * (3 * BLOCK_CHARS + 5)
    hashes = block_hashes(text)
    assert len(hashes) == 3
    assert block_hashes(text[: 2 * BLOCK_CHARS]) == hashes[:2]
    assert block_hashes("y" + text[1:])[2] != hashes[2]  # block 2's hash covers block 0
    assert block_hashes("short") == ()


@given(st.lists(st.text(max_size=80), min_size=1, max_size=6), st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_a_conversation_prefix_flattens_to_a_text_prefix(contents, cut):
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    whole, head = flatten_messages(messages), flatten_messages(messages[:cut])
    assert whole.startswith(head)
    assert block_hashes(whole)[: len(block_hashes(head))] == block_hashes(head)


def test_keys_of_each_endpoint():
    hint = hint_for("/v1/chat/completions", {}, chat([{"role": "user", "content": "hi " * 50}]))
    assert hint.chain_id is None and hint.previous_response_id is None and hint.prefix
    hint = hint_for("/v1/completions", {"x-sparsevllm-chain-id": "c1"}, b'{"prompt": [1, 2]}')
    assert hint.chain_id == "c1" and hint.prefix == ()
    hint = hint_for("/v1/chat/completions", {}, chat([], chain_id="c2"))
    assert hint.chain_id == "c2"
    body = json.dumps({"input": "hello", "previous_response_id": "resp_r1_abc"}).encode()
    assert hint_for("/v1/responses", {}, body).previous_response_id == "resp_r1_abc"
    assert hint_for("/v1/responses/resp_r2_x", {}, b"").previous_response_id == "resp_r2_x"
    assert hint_for("/v1/chat/completions", {}, b"not json") == RouteHint()
    assert hint_for("/v1/chat/completions", {}, b"[1, 2]") == RouteHint()
    assert flatten_prompt({"prompt": ["a", "b"]}) is None  # several prompts: no prefix key
    assert flatten_prompt({"input": [{"role": "user", "content": "x"}], "instructions": "be"})


def test_reply_text_extends_the_next_turns_flattened_prompt():
    turn1 = [{"role": "user", "content": "question"}]
    body = {"choices": [{"message": {"role": "assistant", "content": "answer"}}]}
    reply = reply_text("/v1/chat/completions", body)
    turn2 = [*turn1, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "?"}]
    assert reply is not None
    assert flatten_messages(turn2).startswith(flatten_messages(turn1) + reply)
    assert reply_text("/v1/completions", {"choices": [{"text": " more"}]}) == " more"
    assert reply_text("/v1/completions", {"choices": [{"text": "a"}, {"text": "b"}]}) is None


def test_response_ids_name_their_replica():
    rid = "resp_" + response_id_prefix("abc123") + "deadbeef"
    assert response_owner(rid) == "abc123"
    assert response_owner("resp_deadbeef") is None  # a one-server id
    assert response_owner("chatcmpl-x") is None


def test_independent_requests_go_to_the_least_loaded_replica_in_turn():
    policy = RoutingPolicy(seed=0)
    policy.set_replicas(REPLICAS)
    counts = Counter(route(policy, RouteHint(), f"r{i}") for i in range(40))
    assert counts == {"aaa": 20, "bbb": 20}
    assert policy.counts["miss"] == 40
    # Concurrent ones (none completes): still even.
    counts = Counter(route(policy, RouteHint(), f"c{i}", done=False) for i in range(10))
    assert counts == {"aaa": 5, "bbb": 5}


def test_chain_and_prefix_affinity():
    policy = RoutingPolicy(seed=1)
    policy.set_replicas(REPLICAS)
    first = route(policy, RouteHint(chain_id="c"), "1")
    for i in range(5):
        assert route(policy, RouteHint(chain_id="c"), f"c{i}") == first
    prefix = block_hashes("p" * 10 * BLOCK_CHARS)
    owner = route(policy, RouteHint(prefix=prefix[:4]), "p")
    assert route(policy, RouteHint(prefix=prefix), "q") == owner  # 4 of 10 >= 0.3
    assert policy.counts["hit"] == 6
    # A shared head below min_prefix_fraction is no affinity.
    other = prefix[:2] + block_hashes("o" * 10 * BLOCK_CHARS)[2:]
    hint = RouteHint(prefix=other)
    policy.choose(hint, REPLICAS)
    assert hint.decision == "miss"


def test_previous_response_id_routes_to_its_replica_without_state():
    policy = RoutingPolicy(seed=2)
    policy.set_replicas(REPLICAS)
    for i in range(6):
        rid = f"resp_{REPLICAS[i % 2]}_{i:x}"
        assert route(policy, RouteHint(previous_response_id=rid), str(i)) == REPLICAS[i % 2]


def test_a_holder_over_the_imbalance_bound_loses_the_request():
    policy = RoutingPolicy(RouteOptions(max_imbalance=2), seed=3)
    policy.set_replicas(REPLICAS)
    owner = route(policy, RouteHint(chain_id="hot"), "0", done=False)
    hits = [route(policy, RouteHint(chain_id="hot"), f"h{i}", done=False) for i in range(2)]
    assert hits == [owner, owner]  # 1, then 2 in flight against 0: within the bound
    moved = route(policy, RouteHint(chain_id="hot"), "h3", done=False)
    assert moved != owner and policy.counts["overloaded"] == 1


@given(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=120),
    st.integers(0, 4),
)
@settings(max_examples=60, deadline=None)
def test_imbalance_stays_bounded_whatever_the_keys(requests, bound):
    """However skewed the chains, no replica runs more than `bound` + 1 requests above
    the least loaded one (requests never complete here: the worst case)."""
    policy = RoutingPolicy(RouteOptions(max_imbalance=bound), seed=4)
    policy.set_replicas(["a", "b", "c"])
    for i, (chain, named) in enumerate(requests):
        hint = RouteHint(chain_id=f"c{chain}" if named else None)
        chosen = policy.choose(hint, ["a", "b", "c"])[0]
        policy.routed(hint, chosen, str(i))
        loads = [policy.load(r) for r in "abc"]
        assert max(loads) - min(loads) <= bound + 1


def test_dead_replicas_lose_their_chains_and_get_nothing():
    policy = RoutingPolicy(seed=5)
    policy.set_replicas(REPLICAS)
    owner = route(policy, RouteHint(chain_id="c"), "0")
    survivor = next(r for r in REPLICAS if r != owner)
    policy.mark_dead(owner)
    assert policy.lost_key(RouteHint(chain_id="c")) == ("chain_id", "c")
    assert policy.lost_key(RouteHint(previous_response_id=f"resp_{owner}_1")) == (
        "previous_response_id",
        f"resp_{owner}_1",
    )
    assert policy.lost_key(RouteHint(previous_response_id=f"resp_{survivor}_1")) is None
    assert policy.choose(RouteHint(), REPLICAS) == [survivor]
    policy.forget_chain("c")
    assert policy.lost_key(RouteHint(chain_id="c")) is None
    # A replica Ray no longer lists is dead too; a retry excludes the replica it tried.
    policy.set_replicas([survivor, "ccc"])
    assert policy.choose(RouteHint(exclude=frozenset({survivor})), [survivor, "ccc"]) == ["ccc"]


def test_targets_random_mode_and_completion_bookkeeping():
    policy = RoutingPolicy(RouteOptions(random=True), seed=6)
    policy.set_replicas(REPLICAS)
    assert policy.choose(RouteHint(target="bbb"), REPLICAS) == ["bbb"]
    assert policy.choose(RouteHint(target="zzz"), REPLICAS) == []
    seen = Counter(route(policy, RouteHint(chain_id="c"), str(i)) for i in range(200))
    assert min(seen.values()) > 60 and policy.counts["random"] == 200
    policy.routed(RouteHint(), "aaa", "x")
    policy.completed("x")
    policy.completed("x")  # a second report is a no-op
    assert policy.load("aaa") == 0


def test_state_is_bounded():
    cache: LRU[str, int] = LRU(3)
    for i in range(5):
        cache.put(str(i), i)
    assert len(cache) == 3 and cache.get("0") is None and cache.get("4") == 4
    policy = RoutingPolicy(RouteOptions(capacity=10), seed=7)
    policy.set_replicas(REPLICAS)
    for i in range(50):
        route(policy, RouteHint(chain_id=f"c{i}", prefix=block_hashes(f"{i}" * 700)), str(i))
    snap = policy.snapshot()
    assert snap["chains"] <= 10 and snap["blocks"] <= 10


def test_shared_policy_is_one_per_name_and_options_are_checked():
    assert shared_policy("test/x") is shared_policy("test/x")
    assert shared_policy("test/x") is not shared_policy("test/y")
    with pytest.raises(ValueError, match="route-max-imbalance"):
        RouteOptions(max_imbalance=-1)
    with pytest.raises(ValueError, match="--replicas"):
        ReplicaOptions(engine=None, server=ServerOptions("m"), replicas=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--replica-cpus"):
        ReplicaOptions(engine=None, server=ServerOptions("m"), replica_cpus=0)  # type: ignore[arg-type]


def test_the_resource_check_names_what_is_needed_and_what_there_is():
    from sparsevllm.server.replicas.launcher import (
        ReplicaSetupError,
        check_resources,
        probe_address,
        replica_gpus,
    )

    options = ReplicaOptions(engine=None, server=ServerOptions("m"), replicas=3, replica_gpus=1)  # type: ignore[arg-type]
    check_resources(options, {"CPU": 3.0, "GPU": 3.0})
    with pytest.raises(
        ReplicaSetupError, match=r"needs 3 CPUs and 3 GPUs .* has 8 CPUs and 2 GPUs"
    ):
        check_resources(options, {"CPU": 8.0, "GPU": 2.0})
    assert replica_gpus("cpu", 8) == 0 and replica_gpus("auto", 0) == 0
    assert replica_gpus("auto", 1) == 1 and replica_gpus("cuda", 0) == 1
    with pytest.raises(ReplicaSetupError, match="is not HOST:PORT"):
        probe_address("no-port")
    probe_address("auto")  # Ray finds the local cluster itself
