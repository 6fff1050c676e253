"""Radix offload tiers (Llama): the disk tier (bit-exact restore, the cap, restarts),
pruned nodes, and the logical methods that share the radix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radix_offload_helpers import (
    FIRST,
    GREEDY,
    NEW,
    PRESSURE,
    borrowed_rows,
    cached_rows,
    other,
    run_one,
    same_rows,
    squeeze,
)
from sparsevllm import LLM, SamplingParams
from sparsevllm.engine.cache.store import ChainBusyError

HISTORY = len(FIRST) + GREEDY.max_tokens - 1  # what a finished FIRST request caches
PRUNE = dict(ranges=[(20, 120)], keep_ratio=0.25)  # keeps 25 of 100: 75 slots freed


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama4")


def node_bytes(llm: LLM, rows: int = HISTORY) -> int:
    return rows * llm.engine.runner.kv_bytes_per_slot


def follow_up(llm: LLM, follow: list[int]):
    """Run `follow`; returns its output and, read after its first step, the rows and
    logical positions of the prefix it borrowed."""
    engine = llm.engine
    rid = engine.add_request(follow, GREEDY)
    engine.step()
    seq = engine._by_request[rid]
    _, positions = engine.store.tree.view(engine.store.borrowed_node(seq.seq_id))
    rows = borrowed_rows(llm, rid, len(positions))
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
    return out, rows, positions


def calm_reference(model: str, prune: dict | None = None):
    """FIRST, then its follow-up, without pressure (after the same prune, if any)."""
    llm = LLM(model, max_model_len=1024)
    first = run_one(llm, FIRST)
    if prune is not None:
        llm.prune(prompt=FIRST + first.token_ids, **prune)
    follow = FIRST + first.token_ids + NEW
    return first, follow, run_one(llm, follow)


def test_cpu_then_disk_restores_bit_exactly(model, tmp_path):
    first, follow, calm = calm_reference(model)
    probe = LLM(model, **PRESSURE)
    llm = LLM(
        model, **PRESSURE, cpu_offload_gb=node_bytes(probe) / 2**30, disk_offload_dir=str(tmp_path)
    )
    assert run_one(llm, FIRST).token_ids == first.token_ids
    saved, _ = cached_rows(llm, follow)
    squeeze(llm, 4)  # FIRST goes to the CPU, then on to disk to make room for other(0)
    tiers, tiering = llm.engine.store.tiers, llm.engine.store.tiering
    listed = sorted((r["tier"], r["logical_tokens"]) for r in tiering.listing())
    assert listed == [("CPU", HISTORY), ("disk", HISTORY)]
    assert llm.engine.store.tree.root.children[FIRST[0]].tier == "disk"
    assert len(list(tiers.disk.dir.glob("*.pt"))) == 1
    out, rows, _ = follow_up(llm, follow)
    assert same_rows(rows, saved)
    assert out.num_cached_tokens == calm.num_cached_tokens == HISTORY
    assert out.token_ids == calm.token_ids
    # Resident again, its file gone; making room for it pushed other prefixes down a tier.
    assert llm.engine.store.tree.root.children[FIRST[0]].tier is None
    on_disk = [r for r in tiering.listing() if r["tier"] == "disk"]
    assert len(list(tiers.disk.dir.glob("*.pt"))) == len(on_disk) == 1


def test_the_disk_cap_drops_the_oldest_nodes(model, tmp_path):
    probe = LLM(model, **PRESSURE)
    cap = 1.6 * node_bytes(probe)  # one file (KV plus a little metadata)
    llm = LLM(model, **PRESSURE, disk_offload_dir=str(tmp_path), disk_offload_gb=cap / 2**30)
    disk = llm.engine.store.tiers.disk
    for j in range(6):
        run_one(llm, other(j))
        files = list(disk.dir.glob("*.pt"))
        assert sum(f.stat().st_size for f in files) == disk.used_bytes <= disk.capacity_bytes
    assert [r["tier"] for r in llm.engine.store.tiering.listing()] == ["disk"]
    assert llm.engine.store.tree.match(other(0))[0] == []  # left the tree
    # other(2) is the one on disk: restored, then split where NEW diverges.
    assert run_one(llm, other(2) + NEW).num_cached_tokens == len(other(2))


@pytest.mark.parametrize("tier", ["CPU", "disk"])
def test_pruned_nodes_offload_and_restore_with_their_positions(model, tmp_path, tier):
    first, follow, calm = calm_reference(model, PRUNE)
    kw = dict(cpu_offload_gb=0.5) if tier == "CPU" else dict(disk_offload_dir=str(tmp_path))
    llm = LLM(model, **PRESSURE, **kw)
    run_one(llm, FIRST)
    assert llm.prune(prompt=FIRST + first.token_ids, **PRUNE).slots_freed == 75
    saved, positions = cached_rows(llm, follow)
    squeeze(llm)
    [node] = [n for n, _ in llm.engine.store.tree.offloaded()]
    assert node.tier == tier and node.positions is not None
    assert llm.engine.store.tiering.listing()[0]["rows"] == HISTORY - 75
    out, rows, restored = follow_up(llm, follow)
    assert restored == positions and same_rows(rows, saved)
    assert out.num_cached_tokens == HISTORY and out.token_ids == calm.token_ids


def test_pruning_an_offloaded_prefix_without_room_is_refused(model):
    llm = LLM(model, **PRESSURE, cpu_offload_gb=0.5)
    engine = llm.engine
    history = FIRST + run_one(llm, FIRST).token_ids
    squeeze(llm)
    engine.add_request(other(3), SamplingParams(max_tokens=300, ignore_eos=True), "long")
    while engine.pool.num_available >= HISTORY:
        engine.step()
    with pytest.raises(ChainBusyError, match="offloaded .CPU. and the KV pool has no room"):
        llm.prune(prompt=history, **PRUNE)
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.prune(prompt=history, **PRUNE).slots_freed == 75  # restored first


def test_a_restarted_engine_rebuilds_the_offloaded_tree(model, tmp_path):
    first, follow, calm = calm_reference(model, PRUNE)
    before = LLM(model, max_model_len=1024, disk_offload_dir=str(tmp_path))
    run_one(before, FIRST)
    before.prune(prompt=FIRST + first.token_ids, **PRUNE)
    run_one(before, FIRST[:100] + [4, 4, 4])  # a branch: the prefix splits after 100
    saved, positions = cached_rows(before, follow)
    before.close()  # every unlocked node goes to disk
    directory: Path = before.engine.store.tiers.disk.dir
    assert len(list(directory.glob("*.pt"))) == 3
    del before

    after = LLM(model, max_model_len=1024, disk_offload_dir=str(tmp_path))
    spans = [
        (r["tier"], r["start"], r["logical_tokens"]) for r in after.engine.store.tiering.listing()
    ]
    assert spans == [("disk", 0, 100), ("disk", 100, 112), ("disk", 100, HISTORY)]
    out, rows, restored = follow_up(after, follow)
    assert restored == positions and same_rows(rows, saved)
    assert out.num_cached_tokens == HISTORY and out.token_ids == calm.token_ids
    assert len(list(directory.glob("*.pt"))) == 1  # the branch's leaf is still there

    # A chain-cache engine on the same directory neither reads nor deletes radix files.
    chains = LLM(model, sparse_method="snapkv", disk_offload_dir=str(tmp_path))
    assert chains.engine.store.chains.listing() == [] and len(list(directory.glob("*.pt"))) == 1


def test_a_file_whose_parent_is_gone_is_deleted_on_start(model, tmp_path):
    first, follow, calm = calm_reference(model)
    before = LLM(model, max_model_len=1024, disk_offload_dir=str(tmp_path))
    run_one(before, FIRST)
    run_one(before, FIRST[:100] + [4, 4, 4])
    before.close()
    directory: Path = before.engine.store.tiers.disk.dir
    [root_file] = [
        f
        for f in directory.glob("*.pt")
        if torch.load(f, weights_only=True)["tokens"].numel() == 100
    ]
    root_file.unlink()  # e.g. a crash before the parent was written
    after = LLM(model, max_model_len=1024, disk_offload_dir=str(tmp_path))
    assert after.engine.store.tiering.listing() == [] and list(directory.glob("*.pt")) == []
    out = run_one(after, follow)
    assert out.num_cached_tokens == 0 and out.token_ids == calm.token_ids


def test_without_close_what_is_on_disk_still_serves_a_new_engine(model, tmp_path):
    """A killed process: only the nodes already offloaded are on disk; whole-path ones
    are rebuilt."""
    first, follow, calm = calm_reference(model)
    before = LLM(model, **PRESSURE, disk_offload_dir=str(tmp_path))
    run_one(before, FIRST)
    squeeze(before)  # FIRST (a whole path: one node from the root) goes to disk
    after = LLM(model, **PRESSURE, disk_offload_dir=str(tmp_path))
    assert [r["logical_tokens"] for r in after.engine.store.tiering.listing()] == [HISTORY]
    out = run_one(after, follow)
    assert out.num_cached_tokens == HISTORY and out.token_ids == calm.token_ids


@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_logical_methods_read_restored_prefixes_like_resident_ones(model, method):
    kw = dict(sparse_method=method, decode_keep_tokens=64, recent_keep_tokens=16)
    calm_llm = LLM(model, max_model_len=1024, **kw)
    first = run_one(calm_llm, FIRST)
    follow = FIRST + first.token_ids + NEW
    calm = run_one(calm_llm, follow)
    llm = LLM(model, **PRESSURE, **kw, cpu_offload_gb=0.5)
    run_one(llm, FIRST)
    squeeze(llm)
    assert [r["tier"] for r in llm.engine.store.tiering.listing()] == ["CPU"]
    out = run_one(llm, follow)
    assert out.num_cached_tokens == HISTORY and out.token_ids == calm.token_ids
