"""Selections of the simple methods against plain references written from their definitions.

Covers `select_keep` edge cases, StreamingLLM, TOVA, KNorm and OmniKV. Each reference is
deliberately naive (Python loops, float64) and never calls the helpers under test
(`select_keep`, `gqa_mean`, `attention_mass`, ...). The attention probabilities a method
receives are the backend's, `attention_mass` (that is the contract between the two).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sparsevllm.attention.torch_ref import attention_mass
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.knorm import KNorm
from sparsevllm.sparse.omnikv import OmniKV, omnikv_pick
from sparsevllm.sparse.score_eviction import select_keep
from sparsevllm.sparse.streamingllm import StreamingLLM, streaming_keep
from sparsevllm.sparse.tova import TOVA

HQ, HKV, D = 8, 2, 8


class FakeKV:
    """KVAccess over per-(seq, layer) keys and token ids; records and applies evictions.

    `shared=True` models one slot table for every layer (dense methods): `keep` on group 0
    applies to all layers.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, shared: bool = False) -> None:
        self.num_layers, self.num_kv_heads, self.shared = num_layers, num_kv_heads, shared
        self.k: dict[tuple[int, int], torch.Tensor] = {}  # [L, Hkv, D]
        self.ids: dict[tuple[int, int], torch.Tensor] = {}  # [L, Hkv] original token ids
        self.calls: list[tuple] = []

    def append(self, seq: int, layer: int, k: torch.Tensor, ids: list[int]) -> None:
        new_ids = torch.tensor(ids).unsqueeze(1).expand(len(ids), self.num_kv_heads)
        if (seq, layer) in self.k:
            k = torch.cat([self.k[(seq, layer)], k])
            new_ids = torch.cat([self.ids[(seq, layer)], new_ids])
        self.k[(seq, layer)], self.ids[(seq, layer)] = k, new_ids

    def resident(self, seq: int, layer: int) -> int:
        return self.k[(seq, layer)].shape[0]

    def group_of(self, layer: int) -> int:
        return 0 if self.shared else layer

    def keys(self, seq: int, layer: int, start: int = 0, end: int | None = None):
        return self.k[(seq, layer)][start:end]

    def keep(self, seq: int, group: int, positions: list[int]) -> None:
        self.calls.append(("keep", seq, group, list(positions)))
        idx = torch.tensor(positions, dtype=torch.long)
        for layer in range(self.num_layers) if self.shared else [group]:
            self.k[(seq, layer)] = self.k[(seq, layer)][idx]
            self.ids[(seq, layer)] = self.ids[(seq, layer)][idx]

    def keep_per_head(self, seq: int, layer: int, positions: torch.Tensor) -> None:
        self.calls.append(("keep_per_head", seq, layer, positions.clone()))
        rows, heads = positions.t(), torch.arange(self.num_kv_heads)
        self.k[(seq, layer)] = self.k[(seq, layer)][rows, heads]
        self.ids[(seq, layer)] = self.ids[(seq, layer)][rows, heads]


def ref_keep(scores: list[float], budget: int, sink: int, recent: int) -> list[int]:
    """Definition: first `sink` + last `recent` + the best of the rest, `budget` in all."""
    n = len(scores)
    if budget >= n:
        return list(range(n))
    middle = list(range(sink, n - recent))
    best = sorted(middle, key=lambda j: -scores[j])[: budget - sink - recent]
    return sorted(list(range(sink)) + best + list(range(n - recent, n)))


def ref_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def ref_last_query_probs(q: torch.Tensor, k: torch.Tensor) -> list[list[float]]:
    """Per query head, softmax of the last query over every key: `[Hq][L]` (float64)."""
    hq, hkv = q.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = []
    for h in range(hq):
        kv_head = h // (hq // hkv)
        logits = [float(q[h].double() @ k[j, kv_head].double()) * scale for j in range(len(k))]
        out.append(ref_softmax(logits))
    return out


def cfg(method: str, **knobs) -> EngineConfig:
    return EngineConfig.create(sparse_method=method, **knobs)


# -- select_keep ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget,sink,recent", [(10, 2, 3), (7, 0, 4), (9, 3, 0), (12, 0, 0)])
def test_select_keep_matches_reference(seed, budget, sink, recent):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(3, 40, generator=g, dtype=torch.float64)
    got = select_keep(scores, budget, sink, recent)
    assert got.shape == (3, budget)
    for h in range(3):
        assert got[h].tolist() == ref_keep(scores[h].tolist(), budget, sink, recent)


@pytest.mark.parametrize("budget", [20, 21, 100])
def test_select_keep_budget_at_least_length_keeps_all(budget):
    got = select_keep(torch.rand(2, 20), budget, 4, 4)
    assert got.tolist() == [list(range(20))] * 2


def test_select_keep_sink_plus_recent_equals_budget_ignores_scores():
    scores = torch.zeros(2, 30)
    scores[:, 5:25] = 1.0  # the middle scores highest, yet there is no room for it
    got = select_keep(scores, 10, 4, 6)
    assert got.tolist() == [list(range(4)) + list(range(24, 30))] * 2


@pytest.mark.parametrize("scores", [torch.zeros(2, 30), torch.ones(2, 30).tril(3)])
def test_select_keep_ties_give_distinct_positions(scores):
    got = select_keep(scores, 12, 2, 3)
    for row in got.tolist():
        assert row == sorted(set(row)) and len(row) == 12
        assert {0, 1, 27, 28, 29} <= set(row)


# -- StreamingLLM -----------------------------------------------------------------------
@pytest.mark.parametrize("length", [0, 1, 5, 12, 13, 14, 50])
@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 5), (3, 0)])
def test_streaming_keep_matches_definition(length, sink, recent):
    ref = [p for p in range(length) if length <= sink + recent or p < sink or p >= length - recent]
    assert streaming_keep(length, sink, recent) == ref


def test_streamingllm_after_step_keeps_sinks_and_window_through_chunks_and_decode():
    sink, recent, layers = 3, 7, 2
    m = StreamingLLM(cfg("streamingllm", sink_keep_tokens=sink, recent_keep_tokens=recent), 2, 2)
    kv = FakeKV(layers, HKV, shared=True)
    # Two sequences in one batch: seq 0 prefills 25 tokens in chunks of 8, seq 1 has 6.
    plans = {0: [8, 8, 8, 1] + [1] * 6, 1: [6] + [1] * 9}
    prompt = {0: 25, 1: 6}
    done = {0: 0, 1: 0}
    for t in range(10):
        steps = []
        for row, seq in enumerate((0, 1)):
            n = plans[seq][t]
            ids = list(range(done[seq], done[seq] + n))
            for layer in range(layers):
                kv.append(seq, layer, torch.randn(n, HKV, D), ids)
            steps.append(SeqStep(seq, row, done[seq], n, prompt[seq]))
            done[seq] += n
        kv.calls.clear()
        m.after_step(steps, {}, kv)
        assert all(c[0] == "keep" and c[2] == 0 for c in kv.calls)  # one shared table
        for seq in (0, 1):
            total = done[seq]
            if total <= sink + recent:
                ref = list(range(total))
            else:
                ref = list(range(sink)) + list(range(total - recent, total))
            for layer in range(layers):
                assert kv.ids[(seq, layer)][:, 0].tolist() == ref


# -- TOVA -------------------------------------------------------------------------------
def ref_tova(q_last: torch.Tensor, k: torch.Tensor, budget: int) -> tuple[list[int], float]:
    """Top-`budget` tokens by the last query's attention averaged over all query heads.

    Also returns the score gap at the cut (to show the seed has no near-tie)."""
    probs = ref_last_query_probs(q_last, k)
    avg = [sum(p[j] for p in probs) / len(probs) for j in range(len(k))]
    order = sorted(range(len(k)), key=lambda j: -avg[j])
    return sorted(order[:budget]), avg[order[budget - 1]] - avg[order[budget]]


@pytest.mark.parametrize("seed", range(3))
def test_tova_matches_reference_over_prefill_and_decode(seed):
    torch.manual_seed(seed)
    budget, layers, prompt = 12, 2, 30
    m = TOVA(cfg("tova", decode_keep_tokens=budget, sink_keep_tokens=0, recent_keep_tokens=0), 2, 2)
    kv = FakeKV(layers, HKV)
    keys = {layer: torch.randn(prompt + 10, HKV, D) for layer in range(layers)}
    queries = {layer: torch.randn(prompt + 10, HQ, D) for layer in range(layers)}
    start, evictions = 0, 0
    for n in [10, 10, 10] + [1] * 10:
        step = SeqStep(0, 0, start, n, prompt)
        # Mid-prompt chunks neither ask nor evict: the prompt is cut once, at its end.
        selects = end_of_prompt_or_later = start + n >= prompt
        assert m.score_rows(step) == int(selects)
        end, scores, refs = start + n, {}, {}
        for layer in range(layers):
            kv.append(0, layer, keys[layer][start:end], list(range(start, end)))
            view = kv.keys(0, layer)
            q = queries[layer][end - 1 : end]
            scores[layer] = [attention_mass(q, view, D**-0.5)]
            if end_of_prompt_or_later and len(view) > budget:
                ids = kv.ids[(0, layer)][:, 0]
                keep, gap = ref_tova(q[0], view, budget)
                assert gap > 1e-6
                refs[layer] = ids[keep].tolist()
        kv.calls.clear()
        m.after_step([step], scores, kv)
        assert len(kv.calls) == len(refs)
        evictions += len(refs)
        for layer in range(layers):
            ids = kv.ids[(0, layer)]
            assert (ids == ids[:, :1]).all()  # the same tokens for every head
            if layer in refs:
                assert ids[:, 0].tolist() == refs[layer]
        start = end
    assert evictions == 2 * 11  # the prompt's end and every decode step, in both layers


# -- KNorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_knorm_keeps_lowest_norm_keys_per_kv_head(seed):
    torch.manual_seed(seed)
    budget, sink, recent, layers, prompt = 16, 2, 4, 3, 50
    c = cfg("knorm", decode_keep_tokens=budget, sink_keep_tokens=sink, recent_keep_tokens=recent)
    m = KNorm(c, layers, HKV)
    kv = FakeKV(layers, HKV)
    keys = {layer: torch.randn(prompt, HKV, D, dtype=torch.float64) for layer in range(layers)}
    # The first chunk does not finish the prompt: nothing is evicted yet.
    for layer in range(layers):
        kv.append(0, layer, keys[layer][:30], list(range(30)))
    m.after_step([SeqStep(0, 0, 0, 30, prompt)], {}, kv)
    assert kv.calls == []
    for layer in range(layers):
        kv.append(0, layer, keys[layer][30:], list(range(30, prompt)))
    m.after_step([SeqStep(0, 0, 30, 20, prompt)], {}, kv)
    assert [c[2] for c in kv.calls] == list(range(layers))
    for layer in range(layers):
        for h in range(HKV):
            norms = [-math.sqrt(sum(x * x for x in keys[layer][j, h].tolist())) for j in range(50)]
            ref = ref_keep(norms, budget, sink, recent)
            assert kv.ids[(0, layer)][:, h].tolist() == ref
    assert not torch.equal(kv.ids[(0, 0)][:, 0], kv.ids[(0, 0)][:, 1])  # heads differ
    # Decode steps append without further eviction.
    kv.calls.clear()
    for layer in range(layers):
        kv.append(0, layer, torch.randn(1, HKV, D, dtype=torch.float64), [prompt])
    m.after_step([SeqStep(0, 0, prompt, 1, prompt)], {}, kv)
    assert kv.calls == []


def test_knorm_short_prompt_is_not_compressed():
    m = KNorm(cfg("knorm", decode_keep_tokens=16, sink_keep_tokens=2, recent_keep_tokens=4), 1, 2)
    kv = FakeKV(1, HKV)
    kv.append(0, 0, torch.randn(16, HKV, D), list(range(16)))
    m.after_step([SeqStep(0, 0, 0, 16, 16)], {}, kv)
    assert kv.calls == []


# -- OmniKV -----------------------------------------------------------------------------
def ref_omnikv(attn: torch.Tensor, budget: int) -> list[int] | None:
    """Top-`budget` context positions (the query's own last column excluded), head mean."""
    context = attn.shape[1] - 1
    if context <= budget:
        return None
    avg = [
        sum(float(attn[h, j]) for h in range(attn.shape[0])) / attn.shape[0] for j in range(context)
    ]
    return sorted(sorted(range(context), key=lambda j: -avg[j])[:budget])


@pytest.mark.parametrize("seed", range(3))
def test_omnikv_pick_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    for length in (5, 16, 17, 40):
        attn = torch.rand(HQ, length, generator=g, dtype=torch.float64)
        got = omnikv_pick(attn, 16)
        ref = ref_omnikv(attn, 16)
        assert (got is None) if ref is None else got.tolist() == ref
    # The query's own column never competes, however large it is.
    attn = torch.rand(HQ, 30, generator=g)
    attn[:, -1] = 100.0
    assert omnikv_pick(attn, 10).max() < 29


def _omnikv_step(m: OmniKV, layers: int, scores: dict, score_rows: list[int], q: torch.Tensor):
    """One decode step as the runner runs it: begin_step, then every layer."""
    sparse = SimpleNamespace(
        score_rows=score_rows, scores=scores, head_mean=lambda t, dim: t.float().mean(dim)
    )
    batch = SimpleNamespace(sparse=sparse)
    m.begin_step(batch)
    out = {}
    for layer in range(layers):
        for row in range(len(score_rows)):
            sel = m.select_view(layer, row, q, batch)
            out[(layer, row)] = None if sel is None else sel.tolist()
    return out


def _omnikv_ref(full: list[int], layer: int, scores: dict, row: int, budget: int):
    if layer in full:
        return None  # full layers attend to everything
    source = max(f for f in full if f < layer)  # the nearest full layer below
    return ref_omnikv(scores[source][row], budget)


# None: the default, the first layer and every 8th after it.
@pytest.mark.parametrize(
    "full_layers, layers, full", [((0, 3, 5), 8, [0, 3, 5]), (None, 20, [0, 8, 16])]
)
def test_omnikv_select_view_uses_nearest_full_layer_below(full_layers, layers, full):
    torch.manual_seed(0)
    budget = 10
    c = cfg("omnikv", decode_keep_tokens=budget, sink_keep_tokens=0, recent_keep_tokens=0)
    m = OmniKV(c.replace(full_attention_layers=full_layers), layers, HKV)
    assert m.score_layers == frozenset(full)
    lengths = [20, 9]  # row 1's context (8) fits the budget: it reads everything
    scores = {f: [torch.rand(HQ, n) for n in lengths] for f in full}
    got = _omnikv_step(m, layers, scores, [1, 1], torch.randn(HQ, D))
    for layer in range(layers):
        for row in range(2):
            assert got[(layer, row)] == _omnikv_ref(full, layer, scores, row, budget)
    # A sequence that did not ask for scores (not a decode) reads its whole view.
    got = _omnikv_step(m, layers, {f: [None] for f in full}, [0], torch.randn(HQ, D))
    assert all(v is None for v in got.values())


def test_omnikv_select_view_follows_each_decode_steps_scores():
    """Successive decode steps, each begun with begin_step (as `ModelRunner.launch` and
    the decode-graph capture do): every step's picks come from its own scores, never
    from an earlier step's."""
    torch.manual_seed(1)
    layers, budget, full = 8, 10, [0, 3, 5]
    c = cfg("omnikv", decode_keep_tokens=budget, sink_keep_tokens=0, recent_keep_tokens=0)
    m = OmniKV(c.replace(full_attention_layers=tuple(full)), layers, HKV)
    for length in range(20, 26):
        scores = {f: [torch.rand(HQ, length)] for f in full}
        got = _omnikv_step(m, layers, scores, [1], torch.randn(HQ, D))
        for layer in range(layers):
            ref = _omnikv_ref(full, layer, scores, 0, budget)
            assert got[(layer, 0)] == ref, f"view length {length}, layer {layer}"


def test_tova_without_decode_eviction_cuts_the_prompt_once_and_keeps_generated_tokens():
    torch.manual_seed(0)
    budget, prompt = 12, 30
    c = cfg(
        "tova",
        decode_keep_tokens=budget,
        sink_keep_tokens=0,
        recent_keep_tokens=0,
        tova_decode_eviction=False,
    )
    m = TOVA(c, 1, 1)
    kv = FakeKV(1, HKV)
    keys, queries = torch.randn(prompt + 10, HKV, D), torch.randn(prompt + 10, HQ, D)
    start = 0
    for n in [10, 10, 10] + [1] * 10:
        step = SeqStep(0, 0, start, n, prompt)
        assert m.score_rows(step) == int(start + n == prompt)  # decode steps ask nothing
        end = start + n
        kv.append(0, 0, keys[start:end], list(range(start, end)))
        q = queries[end - 1 : end]
        view = kv.keys(0, 0)
        want = kv.ids[(0, 0)][:, 0].tolist()
        if end == prompt:
            want = [want[j] for j in ref_tova(q[0], view, budget)[0]]
        m.after_step([step], {0: [attention_mass(q, view, D**-0.5)]}, kv)
        assert kv.ids[(0, 0)][:, 0].tolist() == want
        start = end
    assert kv.ids[(0, 0)].shape[0] == budget + 10  # every generated token kept
    assert m.decode_resident(prompt, 10) == budget + 10
    assert m.max_resident(prompt, 10) == prompt
