"""The disk tier of the chain cache: bit-exact restore, size cap, and restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import run_request
from sparsevllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FIRST = [1] + [(5 * i) % 240 + 3 for i in range(200)]
NEW = [9, 8, 7]
# Each idle chain keeps ~64 + 10 slots; three 200-token prompts beside it do not fit.
PRESSURE = dict(num_kv_slots=300, chunk_prefill_size=256)
SNAPKV = dict(sparse_method="snapkv", decode_keep_tokens=64, recent_keep_tokens=8)
H2O = dict(sparse_method="h2o", h2o_decode_budget=48, recent_keep_tokens=8)
# State that moves with the chain too: per-head rows (AdaKV), the window's votes (R-KV).
ADAKV = dict(sparse_method="adakv", decode_keep_tokens=64, recent_keep_tokens=8)
RKV = dict(sparse_method="rkv", decode_keep_tokens=64, recent_keep_tokens=8, rkv_interval=4)
# Engines compared bit for bit compute with the same threads: by default each picks the
# cores no other process keeps busy, which under parallel test workers changes between
# engines, and a float32 GEMM's sums follow its thread count.
ONE_THREAD = dict(cpu_threads=1)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def run_one(llm: LLM, prompt: list[int], chain_id: str | None = None):
    return run_request(llm.engine, prompt, GREEDY, chain_id)[0]


def squeeze(llm: LLM, n: int = 3) -> None:
    """Other conversations that need the pool."""
    for j in range(n):
        run_one(llm, [2] + [(7 * i + j) % 240 + 3 for i in range(200)])


def views(llm: LLM, chain_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    engine = llm.engine
    owner = engine.store.chains.chains[chain_id].owner
    out = []
    for layer in range(engine.runner.num_layers):
        table = torch.tensor(engine.pool.table(owner, engine.pool.group_of_layer[layer]))
        out.append(
            (engine.runner.kv_storage[layer].k[table], engine.runner.kv_storage[layer].v[table])
        )
    return out


def second_turn(llm: LLM, first) -> tuple:
    return run_one(llm, FIRST + first.token_ids + NEW, chain_id="keep")


def test_disk_tier_restores_identical_kv_and_output(model, tmp_path):
    calm_llm = LLM(model, **ONE_THREAD, **SNAPKV, **PRESSURE)
    first = run_one(calm_llm, FIRST, chain_id="keep")
    calm = second_turn(calm_llm, first)

    llm = LLM(model, **ONE_THREAD, **SNAPKV, **PRESSURE, disk_offload_dir=str(tmp_path))
    first = run_one(llm, FIRST, chain_id="keep")
    saved = [(k.clone(), v.clone()) for k, v in views(llm, "keep")]
    squeeze(llm)
    chain = llm.engine.store.chains.chains["keep"]
    assert chain.tier == "disk" and not llm.engine.pool.has(chain.owner)
    assert len(list(llm.engine.store.tiers.disk.dir.glob("*.pt"))) >= 1
    rid = llm.engine.add_request(FIRST + first.token_ids + NEW, GREEDY, chain_id="keep")
    for (k0, v0), (k1, v1) in zip(saved, views(llm, "keep")):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    out = None
    while llm.engine.has_unfinished_requests():
        out = next((o for o in llm.engine.step() if o.request_id == rid and o.finished), out)
    assert out.chain_status == "continued (restored from disk)"
    assert out.token_ids == calm.token_ids
    assert out.num_cached_tokens == calm.num_cached_tokens == len(FIRST) + 9


def test_cpu_tier_first_then_disk_and_the_size_cap(model, tmp_path):
    one_chain = 110_000 / 2**30  # bytes of about one idle chain's file (~75 KB)
    llm = LLM(
        model, **SNAPKV, **PRESSURE, cpu_offload_gb=one_chain, disk_offload_dir=str(tmp_path),
        disk_offload_gb=one_chain,
    )  # fmt: skip
    for k in range(6):
        run_one(llm, [1] + [(k * 13 + i) % 240 + 3 for i in range(200)], chain_id=f"c{k}")
    tiers = {c["chain_id"]: c["tier"] for c in llm.engine.store.chains.listing()}
    disk = llm.engine.store.tiers.disk
    files = list(disk.dir.glob("*.pt"))
    assert len(files) == list(tiers.values()).count("disk") == 1
    assert sum(f.stat().st_size for f in files) == disk.used_bytes <= disk.capacity_bytes
    # Two chains stay resident; the newest offloaded one is on the CPU, the one before it
    # on disk, and the older ones were dropped when the full disk tier made room.
    assert tiers == {"c2": "disk", "c3": "CPU", "c4": None, "c5": None}
    assert llm.engine.stats()["num_preemptions"] == 0


@pytest.mark.parametrize("method", [SNAPKV, H2O, ADAKV, RKV], ids=["snapkv", "h2o", "adakv", "rkv"])
def test_a_restarted_engine_continues_a_saved_chain(model, tmp_path, method):
    calm_llm = LLM(model, **ONE_THREAD, **method)
    first = run_one(calm_llm, FIRST, chain_id="keep")
    calm = second_turn(calm_llm, first)

    before = LLM(model, **ONE_THREAD, **method, disk_offload_dir=str(tmp_path))
    assert run_one(before, FIRST, chain_id="keep").token_ids == first.token_ids
    assert run_one(before, [3, 4, 5]).chain_id == "chain-1"
    before.close()  # idle chains go to disk
    directory = before.engine.store.tiers.disk.dir
    del before

    after = LLM(model, **ONE_THREAD, **method, disk_offload_dir=str(tmp_path))
    listed = after.engine.store.chains.listing()
    assert sorted((c["chain_id"], c["tier"], c["logical_tokens"]) for c in listed) == [
        ("chain-1", "disk", 3 + 9),
        ("keep", "disk", len(FIRST) + 9),
    ]
    out = second_turn(after, first)
    assert out.chain_status == "continued (restored from disk)"
    assert out.num_cached_tokens == len(FIRST) + 9
    assert out.token_ids == calm.token_ids
    # The method's own state came back too: the next compression kept the same tokens.
    for (k0, v0), (k1, v1) in zip(views(calm_llm, "keep"), views(after, "keep")):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert len(list(directory.glob("*.pt"))) == 1  # "keep" is resident again
    # A new conversation is named past the ids the saved chains keep.
    assert run_one(after, [7, 7, 7]).chain_id == "chain-2"


def test_other_configurations_and_broken_files_are_not_used(model, tmp_path):
    before = LLM(model, **ONE_THREAD, **SNAPKV, disk_offload_dir=str(tmp_path))
    first = run_one(before, FIRST, chain_id="keep")
    before.close()
    directory: Path = before.engine.store.tiers.disk.dir
    (directory / "half-written.tmp").write_bytes(b"\0" * 100)
    (directory / "garbage.pt").write_bytes(b"not a torch file")

    # Another budget shapes the KV differently: its engine neither sees nor deletes it.
    other = LLM(
        model, **ONE_THREAD, **{**SNAPKV, "decode_keep_tokens": 96}, disk_offload_dir=str(tmp_path)
    )
    assert other.engine.store.chains.listing() == []
    out = run_one(other, FIRST + first.token_ids + NEW, chain_id="keep")
    assert out.chain_status == "not_found"

    same = LLM(model, **ONE_THREAD, **SNAPKV, disk_offload_dir=str(tmp_path))
    assert len(list(directory.iterdir())) == 1  # the leftovers went, the chain stayed
    assert [c["chain_id"] for c in same.engine.store.chains.listing()] == ["keep"]
    # Pruning brings the chain back, and its ranges still mean the saved history's
    # tokens: 200-209 (the prompt's last token and the answer) are all resident.
    assert same.prune("keep", ranges=[(200, 210)], keep_ratio=0.5).slots_freed == 5
    assert second_turn(same, first).chain_status == "continued"


def test_disk_tier_settings_are_validated(model, tmp_path):
    # Both caches have tiers now (radix: test_radix_offload.py); no cache, no tier.
    for kw in (dict(disk_offload_dir=str(tmp_path)), dict(cpu_offload_gb=1.0)):
        name = next(iter(kw))
        with pytest.raises(ValueError, match=f"{name} needs prefix caching"):
            LLM(model, **ONE_THREAD, **SNAPKV, **kw, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="disk_offload_gb must be > 0"):
        LLM(model, **ONE_THREAD, **SNAPKV, disk_offload_dir=str(tmp_path), disk_offload_gb=0)


def test_restoring_from_cpu_under_pressure_keeps_the_chain_off_disk(model, tmp_path):
    """Restoring a CPU chain may push other chains out, demoting the oldest CPU chains to
    disk: never the chain being restored."""
    two_chains = 160_000 / 2**30
    llm = LLM(
        model, **SNAPKV, **PRESSURE, cpu_offload_gb=two_chains, disk_offload_dir=str(tmp_path)
    )
    firsts = [
        run_one(llm, [1] + [(k * 13 + i) % 240 + 3 for i in range(200)], f"c{k}") for k in range(4)
    ]
    tiers = {c["chain_id"]: c["tier"] for c in llm.engine.store.chains.listing()}
    assert tiers == {"c0": "CPU", "c1": "CPU", "c2": None, "c3": None}
    engine = llm.engine
    engine.add_request([5] * 100, SamplingParams(max_tokens=60, ignore_eos=True), "other")
    while engine.pool.num_free >= 73:  # c0 holds 73 slots: restoring it must make room
        engine.step()
    prompt = [1] + [(0 * 13 + i) % 240 + 3 for i in range(200)] + firsts[0].token_ids + NEW
    rid = engine.add_request(prompt, GREEDY, chain_id="c0")
    assert engine.chain_of(rid) == ("c0", "continued (restored from CPU)")
    tiers = {c["chain_id"]: c["tier"] for c in engine.store.chains.listing()}
    assert tiers["c0"] is None and tiers["c2"] == "CPU"
    assert "disk" not in tiers.values() and list(engine.store.tiers.disk.dir.glob("*.pt")) == []
    while engine.has_unfinished_requests():
        engine.step()
