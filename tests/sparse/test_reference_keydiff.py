"""KeyDiff against a plain reference of its definition (float64, Python loops).

Reference, per layer and KV head h at the end of the prompt: the anchor is the mean of
the unit keys k_j / ||k_j|| over every resident token; token j scores -cos(k_j, anchor);
the head keeps the first `sink`, the last `recent` and the best-scored middle tokens,
`decode_keep_tokens` in all, or everything when that covers the prompt. The method runs
on the real KV storage (`eviction_harness.run_sequence`).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from eviction_harness import by_score, make_method, ref_keep, run_sequence
from sparsevllm.cli import main
from sparsevllm.sparse.keydiff import prune_scores
from sparsevllm.sparse.spec import NoKnobs

HKV, D, LAYERS = 2, 8, 2


def ref_keydiff_scores(keys: torch.Tensor, head: int) -> list[float]:
    """-cos(k_j, mean of unit keys) of one head's keys `[L, Hkv, D]`."""
    rows = [[float(x) for x in keys[j, head]] for j in range(keys.shape[0])]
    units = [[x / math.sqrt(sum(y * y for y in r)) for x in r] for r in rows]
    anchor = [sum(u[c] for u in units) / len(units) for c in range(D)]
    a_norm = math.sqrt(sum(x * x for x in anchor))
    out = []
    for r in rows:
        dot = sum(x * y for x, y in zip(r, anchor))
        out.append(-dot / (math.sqrt(sum(x * x for x in r)) * a_norm))
    return out


def random_kv(seed: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # A shared offset gives the keys a clear mean direction, as real keys have.
    offset = torch.randn(HKV, D, generator=g, dtype=torch.float64)
    keys = [torch.randn(length, HKV, D, generator=g, dtype=torch.float64) + offset]
    keys.append(torch.randn(length, HKV, D, generator=g, dtype=torch.float64))
    values = [torch.randn(length, HKV, D, generator=g, dtype=torch.float64) for _ in keys]
    return keys, values


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "length, budget, sink, recent, chunks",
    [
        (50, 16, 2, 4, [30, 20]),
        (40, 12, 0, 0, [40]),
        (33, 20, 4, 8, [7] * 4 + [5]),
        (50, 8, 4, 4, [50]),
    ],
)
def test_keydiff_matches_reference_per_kv_head(seed, length, budget, sink, recent, chunks):
    keys, values = random_kv(seed, length)
    knobs = dict(decode_keep_tokens=budget, sink_keep_tokens=sink, recent_keep_tokens=recent)
    m = make_method("keydiff", LAYERS, HKV, **knobs)
    kept, resident = run_sequence(m, keys, values, chunks, length)
    assert all(r == [sum(chunks[: i + 1])] * LAYERS for i, r in enumerate(resident[:-1]))
    assert resident[-1] == [budget] * LAYERS  # one selection, at the end of the prompt
    for layer in range(LAYERS):
        for h in range(HKV):
            ref = ref_keep(
                by_score(ref_keydiff_scores(keys[layer], h)), length, budget, sink, recent
            )
            assert kept[layer][h].tolist() == ref, (layer, h)
    if budget > sink + recent:
        assert not torch.equal(kept[0][0], kept[0][1])  # heads choose their own tokens


def test_keydiff_budget_covering_the_prompt_keeps_everything_and_decode_appends():
    keys, values = random_kv(5, 30)
    m = make_method("keydiff", LAYERS, HKV, decode_keep_tokens=24, recent_keep_tokens=4)
    kept, resident = run_sequence(m, keys, values, [10, 10, 1, 1, 1, 1, 1, 1], 20)
    assert [r[0] for r in resident] == [10, 20, 21, 22, 23, 24, 25, 26]  # never evicts
    assert all(k.tolist() == [list(range(26))] * HKV for k in kept)


def test_keydiff_decode_after_compression_appends_without_eviction():
    keys, values = random_kv(6, 44)
    m = make_method("keydiff", LAYERS, HKV, decode_keep_tokens=16, recent_keep_tokens=4)
    kept, resident = run_sequence(m, keys, values, [40, 1, 1, 1, 1], 40)
    assert [r[0] for r in resident] == [16, 17, 18, 19, 20]
    assert kept[0][:, -4:].tolist() == [[40, 41, 42, 43]] * HKV


def test_keydiff_prune_scores_are_the_rule_over_the_history():
    keys, _ = random_kv(7, 25)
    positions = torch.arange(25).expand(HKV, 25)
    got = prune_scores(keys[0], positions, NoKnobs())
    for h in range(HKV):
        ref = torch.tensor(ref_keydiff_scores(keys[0], h), dtype=torch.float64)
        torch.testing.assert_close(got[h].double(), ref, atol=1e-6, rtol=1e-6)


def test_keydiff_zero_keys_score_finitely():
    keys = torch.zeros(6, HKV, D)
    keys[3] = 1.0
    assert torch.isfinite(prune_scores(keys, torch.arange(6).expand(HKV, 6), NoKnobs())).all()


def test_methods_lists_keydiff():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["methods", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(out.getvalue())}
    row = rows["keydiff"]
    assert row["family"] == "physical_eviction" and row["prune"] and row["chain_cache"]
    assert row["budget_knob"] == "decode_keep_tokens"
    assert set(row["knobs"]) == {"sink_keep_tokens", "recent_keep_tokens", "decode_keep_tokens"}
