"""Faults injected into the disk tier: a process killed (SIGKILL) while writing, files
damaged after they were written, a disk that is full or unusable. No torn or damaged
file is ever restored, what survived is used, and the cache goes on without the disk."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparsevllm.engine.cache import disk_tier
from sparsevllm.engine.cache.disk_tier import CorruptEntry, DiskTier
from sparsevllm.engine.cache.kv_rows import KVRows
from sparsevllm.engine.cache.tier_stack import TierStack
from sparsevllm.engine.cache.tiering import DISK, DiskRecord
from sparsevllm.engine.kv_pool import KVPool
from sparsevllm.kv.dense import DenseStorage

FINGERPRINT = {"test": "disk-faults"}
ROWS, HEADS, DIM = 64, 4, 32  # an entry of ~64 KiB per layer: writes take a while


def rows_of(i: int) -> list[dict[str, torch.Tensor]]:
    """Entry i's K/V rows for two layers: every value says which entry it belongs to."""
    k = torch.full((ROWS, HEADS, DIM), float(i)) + torch.arange(DIM) / 1000
    return [{"k": k + layer, "v": -(k + layer)} for layer in range(2)]


WRITER = """
import sys
sys.path.insert(0, {src!r}); sys.path.insert(0, {tests!r})
from sparsevllm.engine.cache.disk_tier import DiskTier
from sparsevllm.engine.cache.tiering import DiskRecord
from test_disk_faults import FINGERPRINT, ROWS, rows_of
tier = DiskTier({root!r}, 10**9, FINGERPRINT)
i = {first}
while True:
    tier.write(i, DiskRecord(f"entry-{{i}}", [i]), [ROWS], rows_of(i), {{}})
    print(i, flush=True)
    i += 1
"""


def kill_mid_write(root: Path, first: int, delay_s: float) -> list[int]:
    """Run a process that writes entries without pause and SIGKILL it after `delay_s`
    seconds from its first completed write; returns the entries it reported written."""
    here = Path(__file__).resolve()
    code = WRITER.format(
        src=str(here.parents[2] / "src"), tests=str(here.parent), root=str(root), first=first
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    done = [int(proc.stdout.readline())]
    time.sleep(delay_s)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done += [int(line) for line in proc.stdout.read().split()]
    return done


def test_sigkill_while_writing_leaves_only_whole_files(tmp_path: Path):
    written: list[int] = []
    for round_, delay in enumerate((0.013, 0.061)):
        written += kill_mid_write(tmp_path, 1000 * (round_ + 1), delay)
    tier = DiskTier(str(tmp_path), 10**9, FINGERPRINT)
    found = tier.scan()
    assert not list(tier.dir.glob("*.tmp"))  # leftovers of the killed writes are gone
    names = {s.name for s in found}
    # Every write a process reported finished survived its death (and nothing else).
    assert {f"entry-{i}" for i in written} <= names
    assert len(names) <= len(written) + 2  # at most one more per kill: renamed, not printed
    for key, saved in enumerate(found):
        tier.register(key, saved)
        rows, _ = tier.read(key)  # every survivor reads back bit for bit
        i = int(saved.name.removeprefix("entry-"))
        expected = rows_of(i)
        assert all(torch.equal(got[n], want[n]) for got, want in zip(rows, expected) for n in want)


def _flip_a_byte_of_the_rows(path: Path) -> None:
    data = bytearray(path.read_bytes())
    marker = rows_of(7)[0]["k"].reshape(-1)[:4].numpy().tobytes()  # entry 7's first K values
    at = data.find(marker)
    assert at > 0
    data[at + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_or_truncated_file_is_never_restored(tmp_path: Path, caplog):
    tier = DiskTier(str(tmp_path), 10**9, FINGERPRINT)
    for i in (7, 8):
        assert tier.write(i, DiskRecord(f"entry-{i}", [i]), [ROWS], rows_of(i), {})
    by_name = {tier._entries[i].path: i for i in (7, 8)}
    damaged = next(p for p, i in by_name.items() if i == 7)
    truncated = next(p for p, i in by_name.items() if i == 8)
    _flip_a_byte_of_the_rows(damaged)
    truncated.write_bytes(truncated.read_bytes()[:1000])
    restarted = DiskTier(str(tmp_path), 10**9, FINGERPRINT)
    with caplog.at_level(logging.WARNING):
        found = restarted.scan()
    assert [s.path for s in found] == [damaged]  # the truncated one: discarded at start
    assert "discarding" in caplog.text and not truncated.exists()
    restarted.register(7, found[0])
    with pytest.raises(CorruptEntry, match="does not hold what was written"):
        restarted.read(7)


class Store:
    """A store of slot runs (`TierClient`) that records what the stack gave up."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.discarded: list[int] = []

    def describe(self, key: int) -> DiskRecord:
        return DiskRecord(f"entry-{key}", [key])

    def allocate(self, key: int, counts: list[int]) -> list[list[int]]:
        return [self.pool.take_slots(counts[0])]

    def moved(self, key: int, tier: str) -> None:
        pass

    def discard(self, key: int) -> None:
        self.discarded.append(key)


def stack_over(root: Path) -> tuple[TierStack, Store, KVPool, list[torch.Tensor]]:
    pool = KVPool(ROWS * 4, 2, [[0, 1]])
    k = [torch.zeros(ROWS * 4, HEADS, DIM) for _ in range(2)]
    v = [torch.zeros(ROWS * 4, HEADS, DIM) for _ in range(2)]
    rows = KVRows([DenseStorage.wrap(a, b) for a, b in zip(k, v)], pool.group_of_layer)
    stack = TierStack(pool, rows, None, DiskTier(str(root), 10**9, {}))
    store = Store(pool)
    stack.bind(store)
    return stack, store, pool, k


def test_a_damaged_file_is_dropped_at_restore_and_the_store_told(tmp_path: Path):
    stack, store, pool, k = stack_over(tmp_path)
    slots = pool.take_slots(ROWS)
    for layer, rows in enumerate(rows_of(7)):
        k[layer][slots] = rows["k"]
    assert stack.offload(7, [slots]) == DISK
    pool.free_slots(slots)
    _flip_a_byte_of_the_rows(next(tmp_path.rglob("*.pt")))
    assert stack.restore(7) is None  # not restored: the store computes it again
    assert store.discarded == [7] and stack.counts(7) is None
    assert not list(tmp_path.rglob("*.pt")) and pool.num_free == pool.num_slots


def test_a_full_disk_degrades_the_tier_with_one_warning(tmp_path: Path, monkeypatch, caplog):
    stack, store, pool, _ = stack_over(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.torch, "save", full)
    with caplog.at_level(logging.WARNING):
        for key in range(3):
            slots = pool.take_slots(8)
            assert stack.offload(key, [slots]) is None  # not kept: the store frees it
            pool.free_slots(slots)
    assert caplog.text.count("cannot write") == 1 and "No space left" in caplog.text
    assert stack.disk is not None and stack.disk.num_write_errors == 3
    assert not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()  # space again: the tier works and says so
    with caplog.at_level(logging.WARNING):
        slots = pool.take_slots(8)
        assert stack.offload(9, [slots]) == DISK
    assert "works again" in caplog.text


def test_an_engine_whose_disk_is_unusable_serves_without_it(tiny_llama: str, tmp_path, caplog):
    from sparsevllm import LLM, SamplingParams

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the tier's directory should be")
    with caplog.at_level(logging.WARNING):
        llm = LLM(tiny_llama, enable_prefix_caching=True, disk_offload_dir=str(blocker / "kv"))
    assert "running without a disk tier" in caplog.text
    out = llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_disk_file_names_are_hashes_of_entry_names(tmp_path: Path):
    """A chain id comes from a client: it must never become a path."""
    tier = DiskTier(str(tmp_path), 10**9, FINGERPRINT)
    hostile = ["../../escape", "/etc/passwd", "a/b\\c", "..", "x" * 300]
    for key, name in enumerate(hostile):
        assert tier.write(key, DiskRecord(name, [1]), [ROWS], rows_of(key), {})
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == len(hostile)
    for f in files:  # <fingerprint digest>/<32 hex digits>.pt, nothing else
        assert f.parent == Path(tier.dir.name) and f.suffix == ".pt"
        assert len(f.stem) == 32 and all(c in "0123456789abcdef" for c in f.stem)
    assert json.loads(json.dumps(FINGERPRINT)) == tier.fingerprint
