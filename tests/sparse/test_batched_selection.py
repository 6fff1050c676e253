"""The batched, device-side selections (`select_views`) against the per-row reference
(`select_view`) on ragged batches: contexts shorter than, equal to and longer than the
budget, GQA, prefill rows among decode rows, and (Quest) many decode steps with pages
completing at different times per row, shared prefixes and reused table rows.
"""

from __future__ import annotations

import pytest
import torch

from select_helpers import HKV, HQ, NO_SINK, D, SlotKV, check_row, make_batch
from sparsevllm.config import EngineConfig
from sparsevllm.sparse import quest_pages
from sparsevllm.sparse.base import SparseMethod, pack_views
from sparsevllm.sparse.omnikv import OmniKV
from sparsevllm.sparse.quest import Quest, batched_page_scores, page_scores


# -- the default hook ---------------------------------------------------------------------
class Scripted(SparseMethod):
    def __init__(self, picks):
        super().__init__(EngineConfig(), 2, HKV)
        self.picks = picks

    def select_view(self, layer, row, q, batch):
        return self.picks[row]


def test_default_select_views_packs_the_per_row_picks():
    kv = SlotKV(2, 64, 0)
    for seq in range(3):
        kv.grow(seq, 10)
    batch = make_batch(kv, [(0, 0, True), (1, 1, True), (2, 2, False)])
    picks = [torch.tensor([1, 4]), torch.tensor([[0, 2, 5], [1, 3, 8]]), None]
    subset, lens = Scripted(picks).select_views(1, torch.zeros(3, HQ, D), batch)
    assert subset.shape == (3, HKV, 3) and subset.dtype == lens.dtype == torch.int32
    assert lens.tolist() == [2, 3, -1]
    for i, p in enumerate(picks):
        check_row(subset, lens, i, p, 9)
    assert Scripted([None] * 3).select_views(0, torch.zeros(3, HQ, D), batch) is None
    empty, n = pack_views([None], HKV, torch.device("cpu"))
    assert empty.shape == (1, HKV, 1) and n.tolist() == [-1]


# -- OmniKV ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dense", [False, True], ids=["per-row-scores", "step-scores"])
def test_omnikv_batched_matches_per_row(seed, dense):
    budget, layers, full = 10, 8, (0, 3, 5)
    c = EngineConfig.create(sparse_method="omnikv", decode_keep_tokens=budget, **NO_SINK)
    c = c.replace(full_attention_layers=full)
    m = OmniKV(c, layers, HKV)
    kv = SlotKV(layers, 256, seed)
    contexts = [3, 10, 11, 25, 40, 17]  # below, at and above the budget
    decode = [True, True, True, False, True, True]
    for seq, n in enumerate(contexts):
        kv.grow(seq, n + 1)
    batch = make_batch(kv, [(s, 7 - s, d) for s, d in enumerate(decode)])
    g = torch.Generator().manual_seed(seed)
    sparse = batch.sparse
    for f in full:  # the backend's probabilities: [Hq, L_i] per asking row
        rows = [torch.rand(HQ, n + 1, generator=g) if d else None for n, d in zip(contexts, decode)]
        sparse.scores[f] = rows
        if dense:  # the decode kernel's form: one zero-padded [S, Hq, W] buffer
            padded = sparse.dense_scores(f)
            del sparse.scores[f]
            sparse.put_step_scores(f, padded, batch.view_lens[0])
    ref_batch = make_batch(kv, [(s, 7 - s, d) for s, d in enumerate(decode)])
    ref_batch.sparse.scores = sparse.row_scores()
    q = torch.randn(len(contexts), HQ, D, generator=g)
    m.begin_step(batch)
    for layer in range(layers):
        got = m.select_views(layer, q, batch)
        if layer in full:
            assert got is None
            continue
        subset, lens = got
        assert subset.shape == (len(contexts), HKV, budget)  # fixed by the config
        for i, n in enumerate(contexts):
            ref = m.select_view(layer, i, q[i], ref_batch)
            check_row(subset, lens, i, ref, n)
            assert int(lens[i]) == (-1 if not decode[i] else min(n, budget))


def test_omnikv_picks_last_one_step():
    """A method keeps a step's picks on itself; begin_step starts the next step afresh, so
    a later step (or a captured graph after its warm-up run) picks from its own scores."""
    budget, layers, full = 4, 4, (0, 2)
    c = EngineConfig.create(sparse_method="omnikv", decode_keep_tokens=budget, **NO_SINK)
    c = c.replace(full_attention_layers=full)
    kept = OmniKV(c, layers, HKV)
    kv = SlotKV(layers, 128, 0)
    for seq in range(2):
        kv.grow(seq, 20)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, HQ, D, generator=g)

    def batch(probs):  # the decode kernel's probabilities at the full layers
        batch = make_batch(kv, [(0, 0, True), (1, 1, True)])
        for f, p in zip(full, probs):
            batch.sparse.put_step_scores(f, p, [20, 20])
        return batch

    for step in range(3):
        probs = [torch.rand(2, HQ, 20, generator=g) for _ in full]
        ours = batch(probs)
        kept.begin_step(ours)
        got = [kept.select_views(layer, q, ours) for layer in (1, 3)]
        fresh = OmniKV(c, layers, HKV)  # no earlier step at all
        theirs = batch(probs)
        fresh.begin_step(theirs)
        want = [fresh.select_views(layer, q, theirs) for layer in (1, 3)]
        for (subset, lens), (ref, ref_lens) in zip(got, want):
            assert lens.tolist() == ref_lens.tolist() == [budget, budget]
            assert torch.equal(subset, ref), f"step {step}"


# -- Quest ----------------------------------------------------------------------------------
def quest(budget: int, size: int, layers: int = 3) -> Quest:
    c = EngineConfig.create(
        sparse_method="quest",
        decode_keep_tokens=budget,
        quest_chunk_size=size,
        quest_skip_layers=1,
        **NO_SINK,
    )
    return Quest(c, layers, HKV)


def test_batched_page_scores_match_page_scores():
    g = torch.Generator().manual_seed(0)
    bounds = torch.randn(20, 2, HKV, D, generator=g).sort(dim=1).values  # min <= max
    table = torch.randint(0, 20, (3, 6), generator=g, dtype=torch.int32)
    full = torch.tensor([6, 0, 4], dtype=torch.int32)
    q = torch.randn(3, HQ, D, generator=g)
    got = batched_page_scores(q, bounds, table, full)
    assert got.shape == (3, HKV, 6)
    for i in range(3):
        n = int(full[i])
        ids = table[i, :n].long()
        ref = page_scores(q[i], bounds[ids, 0], bounds[ids, 1], HKV)
        torch.testing.assert_close(got[i, :, :n], ref, rtol=1e-5, atol=1e-5)
        assert torch.isneginf(got[i, :, n:]).all()


def run_quest_steps(m: Quest, kv: SlotKV, schedule, q_seed: int, graph: bool = False) -> int:
    """Per step: (rows of the batch, sequences that finish after it); compares every
    sparse layer's batched selection with select_view. Returns rows checked sparse.

    `graph`: select_views sees what a captured decode graph gives it: the flags of a
    capture's begin_step, not this step's (begin_step still runs on the host before each
    replay, for the pages)."""
    g = torch.Generator().manual_seed(q_seed)
    checked = 0
    for rows, finished in schedule:
        batch = make_batch(kv, rows)
        m.begin_step(batch)
        if graph:
            m.begin_step(make_batch(kv, rows, capturing=True))
        q = torch.randn(len(rows), HQ, D, generator=g)
        for layer in range(kv.num_layers):
            got = m.select_views(layer, q, batch)
            refs = [m.select_view(layer, i, q[i], batch) for i in range(len(rows))]
            if got is None:
                assert all(r is None for r in refs)
                continue
            subset, lens = got
            width = max(m.config.decode_keep_tokens, m.knobs.quest_chunk_size - 1)
            assert subset.shape == (len(rows), HKV, width)  # fixed by the config
            for i, (seq, _, _) in enumerate(rows):
                check_row(subset, lens, i, refs[i], len(kv.views[seq]) - 1)
                checked += refs[i] is not None
        for seq in finished:
            m.release(seq)
        for seq, _, _ in rows:
            if seq not in finished:
                kv.grow(seq)
    return checked


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("budget,size", [(24, 4), (20, 8), (13, 5), (6, 8)])
def test_quest_batched_matches_per_row_over_decode(seed, budget, size):
    layers = 3
    m, kv = quest(budget, size, layers), SlotKV(layers, 1024, seed)
    kv.grow(0, 50)
    kv.grow(1, 16)
    kv.grow(2, 7, prefix=kv.views[0][:37])  # a radix-shared prefix, branching mid-page
    kv.grow(3, 30)
    schedule = []
    for t in range(30):
        rows = [(0, 5, True), (1, 2, True), (2, 0, True)]
        if t < 10:
            rows.append((3, 3, True))
        elif t == 10:  # a fresh sequence's last prompt token, then its decode on row 3
            kv.grow(4, 40)
            rows.append((4, 3, False))
        else:
            rows.append((4, 3, True))
        schedule.append((rows, {3} if t == 9 else set()))
    checked = run_quest_steps(m, kv, schedule, seed)
    assert checked > 30 * 2
    # Seq 2 shares seq 0's first page(s) up to the branch: the pool holds them once.
    shared = 37 // size
    assert m.pages._seq_pages[2][:shared] == m.pages._seq_pages[0][:shared]
    for seq in (0, 1, 2, 4):
        m.release(seq)
    assert m.pages.pages_in_use() == 0 and m._pages == {}


@pytest.mark.parametrize("budget", [4, 64])  # sparse, and within the budget throughout
def test_quest_views_as_a_captured_graph_computes_them(budget):
    m, kv = quest(budget, 4), SlotKV(3, 128, 2)
    m.prepare_graph_capture(kv, 6, 40)  # before capture: table and pool at final shapes
    table, bounds = m.pages.table, dict(m.pages.bounds)
    assert table.shape == (6, 10) and m.pages.capacity == 128 // 4 + 6 and m.graph_epoch == 0
    kv.grow(0, 13)
    kv.grow(1, 3)
    schedule = [([(0, 2, True), (1, 5, True)], set()) for _ in range(12)]
    checked = run_quest_steps(m, kv, schedule, 3, graph=True)
    assert (checked > 12) if budget == 4 else (checked == 0)
    # The graph's tensors were updated in place, never replaced.
    assert m.pages.table is table and all(m.pages.bounds[la] is t for la, t in bounds.items())
    assert m.graph_epoch == 0


def test_quest_page_pool_grows_and_rows_move(monkeypatch):
    monkeypatch.setattr(quest_pages, "_CHUNK_PAGES", 3)  # bounds computed in several gathers
    m, kv = quest(8, 4), SlotKV(3, 64, 3)  # 64 slots -> a first pool of 16 + 8 pages
    kv.grow(0, 30)
    kv.grow(1, 20)
    schedule = [([(0, 1, True), (1, 4, True)], set())]
    schedule += [([(0, 6, True), (1, 4, True)], set()) for _ in range(6)]  # seq 0 moved
    run_quest_steps(m, kv, schedule, 0)
    assert m.pages.capacity == 64 // 4 + 8
    for seq in range(2, 5):  # more pages than the first pool holds (no page shared)
        kv.views[seq] = list(range(seq, 60))
    rows = [(seq, seq, True) for seq in range(2, 5)]
    checked = run_quest_steps(m, kv, [(rows, {2, 3, 4})], 1)
    assert checked == 3 * 2 and m.pages.capacity >= 2 * (64 // 4 + 8)
    assert m.graph_epoch == 2  # grew twice (24 -> 48 -> 96): graphs are captured again


# -- inside the engine ----------------------------------------------------------------------
@pytest.mark.parametrize("method", ["quest", "omnikv"])
def test_engine_batched_path_equals_per_row_path(tiny_model_factory, method, monkeypatch):
    """Greedy tokens with the batched hooks equal those with the per-row reference packed
    by the base class, with chunked prefill, pages completing mid-decode and (second
    round) fully cached prompts whose last token is a one-token prefill row."""
    from sparsevllm import LLM, SamplingParams

    model = tiny_model_factory("llama4")
    prompts = [[1] + list(range(10, 70)), [1] + list(range(100, 125)), [1, 5, 6]]
    prompts += [[1] + list(range(200, 241))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    knobs = {
        "omnikv": {"full_attention_layers": (0, 2)},
        "quest": {"quest_skip_layers": 1, "quest_chunk_size": 4},
    }
    kwargs = dict(
        sparse_method=method,
        decode_keep_tokens=16,
        recent_keep_tokens=4,
        chunk_prefill_size=7,
        **knobs[method],
    )

    def run() -> list[list[int]]:
        llm = LLM(model, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[::-1], params, use_tqdm=False)
        return [o.token_ids for o in outs]

    batched = run()
    cls = type(LLM(model, **kwargs).engine.method)
    monkeypatch.setattr(cls, "select_views", SparseMethod.select_views)
    assert run() == batched


def test_quest_page_pool_is_reserved_with_the_kv_pool(tiny_model_factory):
    from sparsevllm import LLM

    model = tiny_model_factory("llama4")
    common = dict(kv_cache_memory_gb=0.01, quest_chunk_size=4, quest_skip_layers=1)
    dense = LLM(model, sparse_method="vanilla", kv_cache_memory_gb=0.01).engine.runner
    runner = LLM(model, sparse_method="quest", **common).engine.runner
    # 3 sparse layers of 4: bounds cost 3 / 4 of one layer's K+V per slot.
    per_slot = dense.kv_bytes_per_slot
    assert runner.num_slots == int(0.01 * 2**30 // (per_slot + 3 * per_slot / 4 / 4))
    assert runner.method.state_bytes_per_slot(per_slot // 4) == 3 * per_slot / 4 / 4
