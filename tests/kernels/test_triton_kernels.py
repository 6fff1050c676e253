"""Triton kernels vs float64 references built on torch_ref's semantics.

Runs on CUDA tensors when a GPU is present, or on CPU tensors under the Triton
interpreter (TRITON_INTERPRET=1, small shapes); skips otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip(
        "needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter", allow_module_level=True
    )

from sparsevllm.attention import torch_ref  # noqa: E402
from sparsevllm.attention.triton import (  # noqa: E402
    auto_num_splits,
    decode_attention,
    prefill_attention,
    quest_page_minmax,
    quest_page_scores,
    window_attention_mass,
)
from sparsevllm.kv.dense import DenseStorage  # noqa: E402
from sparsevllm.sparse.quest import page_scores  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
ON_GPU = DEVICE.type == "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
HEADS = [(8, 2), (4, 4)]  # (Hq, Hkv): GQA and MHA
DECODE_LENS = [1, 7, 63, 64, 65, 1100] + ([4097, 8192] if ON_GPU else [])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_pool(
    lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Caches, table, rows, view_lens for views of `lens` over randomly permuted slots.

    Slot 0 holds NaN K/V and pads every table row, so reading past a view poisons the
    output; rows are permuted and the table has spare rows.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    num_slots = total + 37
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    k_cache[0] = v_cache[0] = float("nan")
    free = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    num_rows, max_len = len(lens) + 3, max(lens) + 5
    table = torch.zeros(num_rows, max_len, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[: len(lens)].to(torch.int32)
    offset = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = free[offset : offset + n].to(torch.int32)
        offset += n
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = (k_cache.to(dtype), v_cache.to(dtype), table, rows, lens_t)
    return tuple(t.to(DEVICE) for t in out)


def random_subset(lens: list[int], num_kv_heads: int, cap: int, seed: int):
    """Per-head ascending context positions (< L - 1), varied counts incl. 0, `cap`, -1."""
    gen = torch.Generator().manual_seed(seed)
    subset = torch.zeros(len(lens), num_kv_heads, cap, dtype=torch.int32)
    counts = []
    for s, n in enumerate(lens):
        count = min(n - 1, cap, [0, cap, max(1, n // 3)][s % 3])
        for h in range(num_kv_heads):
            pick = torch.randperm(n - 1, generator=gen)[:count].sort().values
            subset[s, h, :count] = pick.to(torch.int32)
        counts.append(-1 if s % 4 == 3 else count)  # -1: the whole view, no subset
    return subset.to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)


def decode_reference(q, k_cache, v_cache, table, rows, lens, scale, subset=None, counts=None):
    """float64 (out [S, Hq, D], probs [S, Hq, max_len]) per torch_ref.gather_selected/attend."""
    num_seqs, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    kc, vc = k_cache.double(), v_cache.double()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    probs = torch.zeros(num_seqs, num_q_heads, table.shape[1], dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(lens[s])
        view = table[int(rows[s]), :n].long()
        if subset is None or int(counts[s]) < 0:
            positions = torch.arange(n, device=q.device).expand(num_kv_heads, n)
            k, v = kc[view], vc[view]
        else:
            sel = subset[s, :, : int(counts[s])].long()  # [Hkv, B]
            k, v = torch_ref.gather_selected(DenseStorage.wrap(kc, vc), view, sel)
            last = torch.full((num_kv_heads, 1), n - 1, device=q.device)
            positions = torch.cat([sel, last], dim=1)  # [Hkv, B + 1]
        qs = q[s : s + 1].double()
        out[s] = torch_ref.attend(qs, k, v, scale)[0]
        kk = k.repeat_interleave(group, dim=1)  # [n', Hq, D]
        p = (torch.einsum("hd,nhd->hn", qs[0], kk) * scale).softmax(dim=-1)  # [Hq, n']
        probs[s].scatter_(1, positions.repeat_interleave(group, dim=0), p)
    return out, probs


def run_decode(
    dtype, heads, head_dim, lens, num_splits, subset_cap=None, scores=False, seed=0, **kw
):
    num_q_heads, num_kv_heads = heads
    k_cache, v_cache, table, rows, view_lens = make_pool(lens, num_kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    subset = counts = None
    if subset_cap is not None:
        subset, counts = random_subset(lens, num_kv_heads, subset_cap, seed)
    out = torch.full_like(q, float("nan"))
    scores_out = None
    if scores:
        scores_out = torch.full(
            (len(lens), num_q_heads, table.shape[1]), float("nan"), device=DEVICE
        )
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        view_lens,
        scale,
        out,
        subset=subset,
        subset_lens=counts,
        scores_out=scores_out,
        num_splits=num_splits,
        **kw,
    )
    ref, probs = decode_reference(
        q, k_cache, v_cache, table, rows, view_lens, scale, subset, counts
    )
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    assert rel_err(out, ref) < TOL[dtype]
    if scores:
        assert torch.isfinite(scores_out).all()
        assert rel_err(scores_out, probs) < TOL[dtype]
        for s, n in enumerate(lens):
            assert (scores_out[s, :, n:] == 0).all()
        torch.testing.assert_close(
            scores_out.sum(-1).double(), torch.ones_like(probs.sum(-1)), atol=1e-3, rtol=0
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode(dtype, heads, head_dim, num_splits):
    run_decode(dtype, heads, head_dim, DECODE_LENS, num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("subset_cap", [None, 200])
def test_decode_sequences_fastest_grid_order(num_splits, subset_cap):
    # The benchmark's alternative launch order computes the same thing.
    lens = DECODE_LENS
    run_decode(torch.float32, (8, 2), 64, lens, num_splits, subset_cap, True, heads_fastest=False)


@pytest.mark.parametrize("num_splits", [1, 4, 64])
def test_decode_more_splits_than_tiles(num_splits):
    # Short views leave most splits empty; the merge must ignore them.
    run_decode(torch.float32, (8, 2), 64, [1, 2, 5, 70], num_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_subset(dtype, heads, num_splits):
    run_decode(dtype, heads, 64, DECODE_LENS, num_splits, subset_cap=300, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("subset_cap", [None, 200])
def test_decode_scores(dtype, heads, num_splits, subset_cap):
    run_decode(dtype, heads, 128, DECODE_LENS, num_splits, subset_cap, scores=True, seed=5)


def per_head_reference(q, k_cache, v_cache, table, rows, lens, scale, subset, counts):
    """float64 output when KV head h of sequence s reads subset[s, h, :counts[s, h]] and
    the sequence's own token (one head at a time: no shared count)."""
    num_seqs, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(lens[s])
        view = table[int(rows[s]), :n].long()
        for h in range(num_kv_heads):
            c = int(counts[s, h])
            pos = torch.arange(n - 1) if c < 0 else subset[s, h, :c].long().cpu()
            slots = view[torch.cat([pos, torch.tensor([n - 1])]).to(view.device)]
            k, v = k_cache[slots, h].double(), v_cache[slots, h].double()  # [n', D]
            for g in range(h * group, (h + 1) * group):
                p = (k @ q[s, g].double() * scale).softmax(dim=-1)
                out[s, g] = p @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_subset_counts_per_kv_head(dtype, num_splits):
    # Ada-KV's views: every KV head of a sequence reads its own number of positions
    # (counts [S, Hkv], 0 included); a row of -1 reads the whole view.
    lens = [2, 9, 65, 300]
    k_cache, v_cache, table, rows, view_lens = make_pool(lens, 2, 64, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(dtype).to(DEVICE)
    subset, _ = random_subset([n for n in lens], 2, 200, seed=9)
    full = [min(n - 1, 200, [0, 200, max(1, n // 3)][s % 3]) for s, n in enumerate(lens)]
    counts = torch.tensor([[c, c // 2] for c in full], dtype=torch.int32)
    counts[3] = -1
    counts = counts.to(DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        view_lens,
        0.125,
        out,
        subset=subset,
        subset_lens=counts,
        num_splits=num_splits,
    )
    ref = per_head_reference(q, k_cache, v_cache, table, rows, view_lens, 0.125, subset, counts)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    # The torch reference backend reads the same per-head views.
    for s in range(len(lens)):
        view = table[int(rows[s]), : lens[s]].long()
        sel, mask = torch_ref._row_selection(subset[s], counts[s].cpu())
        storage = DenseStorage.wrap(k_cache.double(), v_cache.double())
        if sel is None:
            k, v = storage.read(view)
        else:
            k, v = torch_ref.gather_selected(storage, view, sel)
        got = torch_ref.attend(q[s : s + 1].double(), k, v, 0.125, key_mask=mask)
        torch.testing.assert_close(got[0], ref[s], atol=1e-9, rtol=1e-9)


def test_decode_padding_row_is_zero():
    # CUDA-graph padding: a sequence with an empty view must produce zeros, not NaN.
    k_cache, v_cache, table, rows, view_lens = make_pool([5, 9], 2, 64, torch.float32)
    view_lens[1] = 0
    q = torch.randn(2, 8, 64, device=DEVICE)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_cache, v_cache, table, rows, view_lens, 0.1, out, num_splits=splits)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_auto_num_splits_depends_on_shapes_only():
    dev = torch.device("cpu")  # assumes 132 SMs (an H100/H200)
    assert auto_num_splits(128, 8, 2112, dev) == 4  # ~24 programs per SM
    assert auto_num_splits(64, 8, 8192, dev) == 7
    assert auto_num_splits(32, 8, 32768, dev) == 13
    assert auto_num_splits(8, 8, 131072, dev) == 50
    assert auto_num_splits(1, 8, 8192, dev) == 32  # capped by MIN_SPLIT_TOKENS
    assert auto_num_splits(1, 8, 1 << 20, dev) == 64  # capped by MAX_SPLITS
    assert auto_num_splits(1, 8, 100, dev) == 1  # too short to split
    assert auto_num_splits(512, 8, 8192, dev) == 1


# (cached prefix, chunk length) per sequence: single tokens, ragged and tile-sized chunks.
# Prefixes 62 and 63 put a chunk's first query just before / on a tile boundary.
PREFILL_BASE = [(0, 1), (5, 7), (0, 63), (70, 64), (0, 65), (3, 130), (62, 66), (63, 5)]
PREFILL_SEQS = PREFILL_BASE + ([(1000, 3000), (0, 4100)] if ON_GPU else [(1000, 40)])


def run_prefill(dtype, heads, head_dim, seqs, window=None, **tiles):
    num_q_heads, num_kv_heads = heads
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, table, rows, view_lens = make_pool(lens, num_kv_heads, head_dim, dtype, 11)
    q_lens = [n for _, n in seqs]
    q_starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        q_starts,
        view_lens,
        scale,
        out,
        max(q_lens),
        window=window,
        **tiles,
    )
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    kc, vc = k_cache.double(), v_cache.double()
    ref = torch.empty(out.shape, dtype=torch.float64, device=DEVICE)
    for s, (start, n) in enumerate(zip(q_starts.tolist(), q_lens)):
        view = table[int(rows[s]), : lens[s]].long()
        ref[start : start + n] = torch_ref.attend(
            q[start : start + n].double(), kc[view], vc[view], scale, window
        )
    assert rel_err(out, ref) < TOL[dtype]
    for start, n in zip(q_starts.tolist(), q_lens):  # every sequence, not just the batch norm
        assert rel_err(out[start : start + n], ref[start : start + n]) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 7, 64, 100])
@pytest.mark.parametrize("block_m,block_n", [(None, None), (32, 16)])
def test_prefill_window(window, block_m, block_n):
    # Sliding-window layers: windows below, at and above the tile size, chunks that start
    # inside and past the window, and a tile mapping where whole tiles precede a window.
    tiles = {} if block_m is None else dict(block_m=block_m, block_n=block_n, num_warps=4)
    run_prefill(torch.float32, (8, 2), 64, PREFILL_BASE, window=window, **tiles)


@pytest.mark.parametrize("window", [1, 5, 64, 300])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window(window, num_splits):
    lens = [1, 7, 63, 64, 65, 1100]
    k_cache, v_cache, table, rows, view_lens = make_pool(lens, 2, 64, torch.float32, 4)
    q = torch.randn(len(lens), 8, 64, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        k_cache,
        v_cache,
        table,
        rows,
        view_lens,
        0.125,
        out,
        window=window,
        num_splits=num_splits,
    )
    kc, vc = k_cache.double(), v_cache.double()
    for s, n in enumerate(lens):
        view = table[int(rows[s]), :n].long()[-window:]
        ref = torch_ref.attend(q[s : s + 1].double(), kc[view], vc[view], 0.125)
        assert rel_err(out[s : s + 1], ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill(dtype, heads, head_dim):
    run_prefill(dtype, heads, head_dim, PREFILL_SEQS)


def test_prefill_long_chunk():
    # A 1000+ query chunk spans many query blocks (one config: the interpreter is slow).
    run_prefill(torch.bfloat16, (8, 2), 64, [(0, 1030)])


@pytest.mark.parametrize("block_m,block_n", [(16, 64), (32, 16), (64, 32), (128, 128), (256, 64)])
def test_prefill_tile_shapes(block_m, block_n):
    # BLOCK_M != BLOCK_N moves the diagonal inside tiles in every way. fp32 (tight
    # tolerance) where it fits in shared memory; the production-size tiles in bf16.
    dtype = torch.float32 if block_m * block_n <= 2048 else torch.bfloat16
    tiles = dict(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    run_prefill(dtype, (8, 2), 64, PREFILL_BASE, **tiles)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window", [1, 8])
def test_window_attention_mass(heads, window):
    num_q_heads, num_kv_heads = heads
    length = 300
    k_cache, _, table, rows, _ = make_pool([length], num_kv_heads, 64, torch.float32, 21)
    q = torch.randn(window, num_q_heads, 64, device=DEVICE)
    storage = DenseStorage.wrap(k_cache, k_cache)
    got = window_attention_mass(q, storage, table[int(rows[0])], length, 0.125)
    view = table[int(rows[0]), :length].long()
    kk = k_cache[view].double().repeat_interleave(num_q_heads // num_kv_heads, dim=1)
    logits = torch.einsum("rhd,lhd->hrl", q.double(), kk) * 0.125
    mask = torch_ref.causal_mask(window, length, DEVICE)
    ref = logits.masked_fill(~mask, float("-inf")).softmax(-1).sum(1)
    assert got.shape == (num_q_heads, length) and got.dtype == torch.float32
    assert rel_err(got, ref) < 1e-5


def test_quest_pages():
    page, num_kv_heads, head_dim = 16, 2, 64
    length = 16 * 9 + 5  # nine full pages and a partial one
    k_cache, _, table, rows, _ = make_pool([length], num_kv_heads, head_dim, torch.bfloat16, 31)
    row = int(rows[0])
    pmin, pmax = quest_page_minmax(DenseStorage.wrap(k_cache, k_cache), table, row, 2, 9, page)
    keys = k_cache[table[row, 2 * page : 9 * page].long()].float().view(7, page, num_kv_heads, -1)
    assert torch.equal(pmin, keys.amin(1)) and torch.equal(pmax, keys.amax(1))
    q = torch.randn(8, head_dim, device=DEVICE)
    got = quest_page_scores(q, pmin, pmax, num_kv_heads)
    ref = page_scores(q.double(), pmin.double(), pmax.double(), num_kv_heads)
    assert got.shape == (num_kv_heads, 7)
    assert rel_err(got, ref) < 1e-5


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replay():
    lens = [300, 4000, 17, 9000]
    k_cache, v_cache, table, rows, view_lens = make_pool(lens, 8, 128, torch.bfloat16, 41)
    q = torch.randn(4, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scores = torch.empty(4, 32, table.shape[1], device=DEVICE)

    def step() -> None:
        decode_attention(q, k_cache, v_cache, table, rows, view_lens, 0.088, out, scores_out=scores)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # New data and shorter views in the same buffers, then replay.
    q.copy_(torch.randn_like(q))
    view_lens.copy_(torch.tensor([299, 1, 9, 8191], dtype=torch.int32, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    ref, probs = decode_reference(q, k_cache, v_cache, table, rows, view_lens, 0.088)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(scores, probs) < TOL[torch.bfloat16]
