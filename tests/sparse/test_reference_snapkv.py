"""SnapKV and PyramidKV against a plain reference of the SnapKV definition.

Reference (float64, loops): the last W prompt queries (window query i sits at position
L - W + i and sees keys 0..L-W+i) vote with their softmax(q k^T * scale); votes are summed
over the window, averaged over the query heads of each KV head (GQA), max-pooled along
the sequence (kernel k, stride 1, same padding), and each KV head keeps positions
[0, sink) + the best `budget - sink - recent` of the middle + the last `recent`.

The methods are driven through their real hooks (`score_rows`, `after_step`), fed with
the backend's `attention_mass` of the rows they ask for, on a fake KVAccess that records
`keep_per_head`. Max pooling makes plateaus of exactly equal scores, so with k > 1 the
check accepts any choice among scores tied (within float32 rounding) at the cut.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparsevllm.attention.torch_ref import attention_mass
from sparsevllm.config import EngineConfig
from sparsevllm.sparse.base import SeqStep
from sparsevllm.sparse.pyramidkv import PyramidKV, pyramid_budgets
from sparsevllm.sparse.snapkv import SnapKV

HQ, HKV, D = 8, 2, 16
SCALE = 1.0 / math.sqrt(D)


class RecordingKV:
    """KVAccess over fixed keys per (seq, layer) whose resident length grows with prefill."""

    def __init__(self, num_layers: int, num_kv_heads: int) -> None:
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.k: dict[tuple[int, int], torch.Tensor] = {}
        self.length: dict[int, int] = {}
        self.calls: list[tuple[int, int, torch.Tensor]] = []

    def resident(self, seq: int, layer: int) -> int:
        return self.length[seq]

    def keys(self, seq: int, layer: int, start: int = 0, end: int | None = None):
        return self.k[(seq, layer)][: self.length[seq]][start:end]

    def keep(self, seq, group, positions):  # pragma: no cover - must not be used
        raise AssertionError("SnapKV selects per KV head")

    def keep_per_head(self, seq: int, layer: int, positions: torch.Tensor) -> None:
        self.calls.append((seq, layer, positions.clone()))


def ref_snapkv_scores(q_win: torch.Tensor, k: torch.Tensor, kernel: int) -> list[list[float]]:
    """`[Hkv][L]` pooled window votes, straight from the definition."""
    w, hq, _ = q_win.shape
    length, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    votes = [[0.0] * length for _ in range(hq)]
    for i in range(w):
        pos = length - w + i  # causal: window query i sees keys 0..pos
        for h in range(hq):
            qv, kh = q_win[i, h].double(), k[: pos + 1, h // group].double()
            logits = [float(kh[j] @ qv) * SCALE for j in range(pos + 1)]
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            for j in range(pos + 1):
                votes[h][j] += e[j] / sum(e)
    per_kv = [
        [sum(votes[g * group + r][j] for r in range(group)) / group for j in range(length)]
        for g in range(hkv)
    ]
    half = kernel // 2
    return [[max(row[max(0, j - half) : j + half + 1]) for j in range(length)] for row in per_kv]


def check_keep(got: list[int], scores: list[float], budget, sink, recent, exact: bool) -> None:
    """`got` is sink + recent + a top-(budget - sink - recent) middle under `scores`.

    Scores within `tol` of the cut are interchangeable (ties); with `exact` there must be
    none, so the reference's choice is unique and `got` must equal it."""
    tol = 1e-5
    n = len(scores)
    assert got == sorted(set(got)), "positions must be ascending and distinct"
    if budget >= n:
        assert got == list(range(n))
        return
    assert len(got) == budget
    fixed = set(range(sink)) | set(range(n - recent, n))
    assert fixed <= set(got)
    middle = range(sink, n - recent)
    m = budget - sink - recent
    if m == 0:
        assert set(got) == fixed
        return
    cut = sorted((scores[j] for j in middle), reverse=True)[m - 1]
    must = {j for j in middle if scores[j] > cut + tol}
    may = {j for j in middle if scores[j] >= cut - tol}
    if exact:
        assert len(may) == m, "seed has a near-tie at the cut; pick another"
    assert must <= set(got) - fixed <= may


def prefill(method, kv, prompts, chunks, q, k):
    """Run chunked prefill of several sequences batched together; return score_rows seen.

    prompts: seq -> prompt length; chunks: seq -> chunk sizes; q/k: (seq, layer) -> [L, H, D].
    """
    done = dict.fromkeys(prompts, 0)
    asked = {seq: [] for seq in prompts}
    for t in range(max(len(c) for c in chunks.values())):
        steps = []
        for seq in prompts:
            if t < len(chunks[seq]):
                steps.append(SeqStep(seq, len(steps), done[seq], chunks[seq][t], prompts[seq]))
        scores = {layer: [None] * len(steps) for layer in range(method.num_layers)}
        for st in steps:
            rows = method.score_rows(st)
            asked[st.seq_id].append(rows)
            kv.length[st.seq_id] = st.end
            if rows:
                for layer in range(method.num_layers):
                    qs = q[(st.seq_id, layer)][st.end - rows : st.end]
                    ks = k[(st.seq_id, layer)][: st.end]
                    scores[layer][st.row] = attention_mass(qs, ks, SCALE)
        method.after_step(steps, scores, kv)
        done.update({st.seq_id: st.end for st in steps})
    return asked


def window_rows(start: int, n: int, prompt: int, w: int) -> int:
    """Window queries (positions >= prompt - w) among positions [start, start + n)."""
    return len(set(range(start, start + n)) & set(range(prompt - w, prompt)))


def random_qk(seqs: dict[int, int], layers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = {
        (s, la): torch.randn(n, HQ, D, generator=g) for s, n in seqs.items() for la in range(layers)
    }
    k = {
        (s, la): torch.randn(n, HKV, D, generator=g)
        for s, n in seqs.items()
        for la in range(layers)
    }
    return q, k


def snap_cfg(method="snapkv", **kw) -> EngineConfig:
    base = dict(decode_keep_tokens=20, sink_keep_tokens=2, recent_keep_tokens=4)
    base.update(snapkv_window_size=8, snapkv_pool_kernel_size=1)
    base.update(kw)
    return EngineConfig.create(sparse_method=method, **base)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_snapkv_matches_reference_per_kv_head(seed, kernel):
    layers, w = 2, 8
    c = snap_cfg(snapkv_pool_kernel_size=kernel, snapkv_window_size=w)
    m = SnapKV(c, layers, HKV)
    # Seq 0 (60 tokens) is chunked with the window split across chunks; seq 1 (45) is
    # prefilled at once in the same batch; seq 2 (18) fits the budget and is left alone.
    prompts = {0: 60, 1: 45, 2: 18}
    chunks = {0: [30, 25, 5], 1: [45], 2: [10, 8]}
    q, k = random_qk(prompts, layers, seed)
    kv = RecordingKV(layers, HKV)
    kv.k = k
    asked = prefill(m, kv, prompts, chunks, q, k)
    for seq, sizes in chunks.items():
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        assert asked[seq] == [window_rows(s, n, prompts[seq], w) for s, n in zip(starts, sizes)]
    assert [(s, la) for s, la, _ in kv.calls] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    for seq, layer, keep in kv.calls:
        length = prompts[seq]
        assert keep.shape == (HKV, 20)
        ref = ref_snapkv_scores(q[(seq, layer)][length - w :], k[(seq, layer)], kernel)
        for h in range(HKV):
            check_keep(keep[h].tolist(), ref[h], 20, 2, 4, exact=kernel == 1)
    assert not torch.equal(kv.calls[0][2][0], kv.calls[0][2][1])  # heads choose differently
    assert m._window == {}  # the window state is dropped when the prompt ends
    # Decode steps neither ask for scores nor evict.
    kv.calls.clear()
    kv.length[0] = 61
    step = SeqStep(0, 0, 60, 1, 60)
    assert m.score_rows(step) == 0
    m.after_step([step], {}, kv)
    assert kv.calls == []


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kernel", [1, 5])
def test_snapkv_selection_does_not_depend_on_chunking(seed, kernel):
    layers, length, w = 2, 50, 10
    c = snap_cfg(snapkv_pool_kernel_size=kernel, snapkv_window_size=w, decode_keep_tokens=16)
    q, k = random_qk({0: length}, layers, seed)
    results = []
    # Whole prompt; window split 4 + 6; split 1 + 9; split 3 + 3 + 4; window in last chunk.
    for sizes in ([50], [44, 6], [41, 9], [43, 3, 4], [20, 30]):
        m = SnapKV(c, layers, HKV)
        kv = RecordingKV(layers, HKV)
        kv.k = k
        asked = prefill(m, kv, {0: length}, {0: sizes}, q, k)
        assert sum(asked[0]) == w
        assert len(kv.calls) == layers
        results.append(torch.stack([keep for _, _, keep in kv.calls]))
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_snapkv_window_longer_than_prompt_scores_every_query():
    c = snap_cfg(snapkv_window_size=32, decode_keep_tokens=16)
    m = SnapKV(c, 1, HKV)
    assert m.score_rows(SeqStep(0, 0, 0, 24, 24)) == 24
    assert m.score_rows(SeqStep(0, 0, 0, 10, 24)) == 10
    q, k = random_qk({0: 24}, 1, 0)
    kv = RecordingKV(1, HKV)
    kv.k = k
    prefill(m, kv, {0: 24}, {0: [10, 14]}, q, k)
    ref = ref_snapkv_scores(q[(0, 0)], k[(0, 0)], 1)
    for h in range(HKV):
        check_keep(kv.calls[0][2][h].tolist(), ref[h], 16, 2, 4, exact=True)


# -- PyramidKV --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mean,layers,beta,floor",
    [(100, 7, 3.0, 9), (2048, 32, 20.0, 37), (64, 12, 2.0, 5), (24, 4, 4.0, 7), (30, 6, 20.0, 10)],
)
def test_pyramid_budgets_shape(mean, layers, beta, floor):
    budgets = pyramid_budgets(mean, layers, beta, floor)
    assert len(budgets) == layers
    assert all(b >= floor for b in budgets)  # the floor holds
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))  # non-increasing with depth
    assert budgets[0] > budgets[-1]
    # Linear from the bottom (~2*mean - mean/beta) to the top (~mean/beta) before rounding
    # and the floor: so the total is mean * layers up to rounding (<= layers / 2) plus
    # whatever the floor adds to the layers it lifts.
    top, bottom = mean / beta, 2 * mean - mean / beta
    linear = [bottom + (top - bottom) * i / (layers - 1) for i in range(layers)]
    lift = sum(max(0.0, floor - x) for x in linear)
    assert abs(budgets[-1] - max(floor, top)) <= 0.5
    assert abs(budgets[0] - bottom) <= 0.5
    assert -layers / 2 <= sum(budgets) - mean * layers <= layers / 2 + lift
    if lift == 0:
        assert abs(sum(budgets) - mean * layers) <= layers / 2


def test_pyramid_budgets_single_layer_and_flat():
    assert pyramid_budgets(50, 1, 20.0, 10) == [50]
    assert pyramid_budgets(5, 1, 20.0, 10) == [10]
    assert pyramid_budgets(40, 5, 1.0, 3) == [40] * 5  # beta 1: no pyramid


@pytest.mark.parametrize("seed", range(3))
def test_pyramidkv_layer_selection_is_snapkv_with_layer_budget(seed):
    layers, w, length = 4, 8, 60
    c = snap_cfg(
        "pyramidkv", decode_keep_tokens=24, pyramidkv_beta=4.0, snapkv_window_size=w
    ).replace(snapkv_pool_kernel_size=3)
    m = PyramidKV(c, layers, HKV)
    budgets = [m.layer_budget(layer) for layer in range(layers)]
    assert budgets == [42, 30, 18, 7]  # 2*24 - 6 ... 24/4 = 6, lifted to 2 + 4 + 1
    q, k = random_qk({0: length}, layers, seed)
    kv = RecordingKV(layers, HKV)
    kv.k = k
    prefill(m, kv, {0: length}, {0: [50, 10]}, q, k)
    assert [layer for _, layer, _ in kv.calls] == list(range(layers))
    for _, layer, keep in kv.calls:
        assert keep.shape == (HKV, budgets[layer])
        ref = ref_snapkv_scores(q[(0, layer)][length - w :], k[(0, layer)], 3)
        for h in range(HKV):
            check_keep(keep[h].tolist(), ref[h], budgets[layer], 2, 4, exact=False)
    assert m.max_resident(60, 10) == max(60, 42 + 10)
