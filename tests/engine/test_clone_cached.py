"""`LLMEngine.clone_cached`: copies of an idle cached history in slots of their own, under
both stores (chain cache: the chain's state under new ids; radix cache: the prefix under
other tokens), read back bit-identically, continued exactly as the original, and
refused as a whole when the pool cannot hold them."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import METHOD_KNOBS
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache.store import CacheEntryNotFound
from sparsevllm.engine.kv_pool import PoolExhausted

PROMPT = [1] + [(7 * i) % 240 + 3 for i in range(40)]
FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
REST = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def build(model: str, method: str, **kw) -> LLM:
    return LLM(model, dtype="float32", sparse_method=method, **METHOD_KNOBS[method], **kw)


def seed(llm: LLM) -> tuple[list[int], str | None]:
    """Prefill PROMPT and sample its first token; its tokens so far and its chain id."""
    engine = llm.engine
    engine.add_request(PROMPT, FIRST)
    [out] = drain(llm)
    return PROMPT + out.token_ids, out.chain_id


def drain(llm: LLM) -> list:
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step(partial_outputs=False) if o.finished]
    return outs


def rows_of(llm: LLM, slots: list[int], layer: int) -> dict[str, torch.Tensor]:
    storage = llm.engine.runner.kv_storage[layer]
    return storage.gather_rows(torch.tensor(slots, dtype=torch.long))


@pytest.mark.parametrize("fmt", ["auto", "int4"])
@pytest.mark.parametrize("method", ["vanilla", "h2o", "adakv"])  # radix; chain; per head
def test_copies_hold_their_own_slots_and_continue_as_the_original(model, method, fmt):
    llm = build(model, method, kv_cache_dtype=fmt, kv_quant_group_size=8, kv_quant_residual=16)
    engine = llm.engine
    tokens, chain_id = seed(llm)
    used = engine.pool.used_per_layer()
    copies = engine.clone_cached(chain_id, PROMPT, count=3)
    assert len(copies) == 3
    grew = [b - a for a, b in zip(used, engine.pool.used_per_layer())]
    assert grew == [3 * n for n in used]  # every layer holds three more of what it held
    if chain_id is None:  # radix: other tokens, first replaced, none cached before
        assert all(c.tokens[1:] == PROMPT[1:] and c.tokens[0] != PROMPT[0] for c in copies)
        assert len({c.tokens[0] for c in copies}) == 3
    else:  # chain: the chain's tokens under new ids
        assert all(c.tokens == PROMPT for c in copies) and len({c.chain_id for c in copies}) == 3
    requests = [(tokens, chain_id)] + [(c.tokens + tokens[-1:], c.chain_id) for c in copies]
    for toks, cid in requests:
        engine.add_request(toks, REST, chain_id=cid)
    engine.step(partial_outputs=False)  # every view is in the pool now
    tables = list(engine.pool.tables.values())
    assert len(tables) == 4
    for g in range(engine.pool.num_groups):
        views = [t[g] for t in tables]
        assert len(set().union(*views)) == sum(len(v) for v in views)  # no slot shared
    for layer in range(engine.runner.num_layers):  # the same stored bytes in every view
        g = engine.pool.group_of_layer[layer]
        first, *others = [rows_of(llm, t[g][: len(PROMPT) // 2], layer) for t in tables]
        for rows in others:
            for name, t in first.items():
                if name not in ("state", "key_groups"):  # KIVI: numbering of its own
                    assert torch.equal(rows[name], t), name
    outs = drain(llm)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.num_cached_tokens >= len(PROMPT) for o in outs)


@pytest.mark.parametrize("method", ["vanilla", "snapkv"])
def test_a_pool_too_small_for_the_copies_copies_nothing(model, method):
    llm = build(model, method, num_kv_slots=160)
    engine = llm.engine
    _, chain_id = seed(llm)
    before = engine.pool.num_used
    with pytest.raises(PoolExhausted, match=r"cannot hold 20 copies .* fit, .* 160 slots"):
        engine.clone_cached(chain_id, PROMPT, count=20)
    assert engine.pool.num_used == before
    assert len(engine.clone_cached(chain_id, PROMPT, count=1)) == 1  # the original is intact


def test_what_is_not_cached_is_not_copied(model):
    llm = build(model, "vanilla")
    seed(llm)
    with pytest.raises(CacheEntryNotFound, match="41 of the 42 tokens"):
        llm.engine.clone_cached(None, PROMPT + [5], count=1)
    with pytest.raises(ValueError, match="no chains"):
        llm.engine.clone_cached("chain-1", PROMPT, count=1)
    off = build(model, "vanilla", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching is off"):
        off.engine.clone_cached(None, PROMPT, count=1)
