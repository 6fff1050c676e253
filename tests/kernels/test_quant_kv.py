"""Quantized KV (int8 / float8_e4m3fn elements, float32 per-token per-head scales) in the
Triton kernels: store_kv against kv.scaled.quantize, decode and prefill against float64
references on the dequantized cache (as test_triton_kernels.py builds them).

Shapes are tiny: under TRITON_INTERPRET=1 these run on the CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention import torch_ref  # noqa: E402
from sparsevllm.attention.triton import decode_attention, prefill_attention, store_kv  # noqa: E402
from sparsevllm.kv.dense import DenseStorage  # noqa: E402
from sparsevllm.kv.scaled import dequantize, quantize  # noqa: E402

FORMATS = [torch.int8, torch.float8_e4m3fn]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
HEAD_DIM = 32
DECODE_LENS = [1, 7, 40, 70]
# (cached prefix, chunk) per sequence; with 16-key tiles the longer prefixes start
# chunks past whole tiles (the unmasked phase) and on / just before a tile boundary.
PREFILL_SEQS = [(0, 1), (5, 7), (0, 20), (30, 17), (62, 5), (70, 10)]

Pool = tuple[torch.Tensor, ...]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def values(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random K/V rows `[..., D]` whose magnitude varies per (token, head) over 100x, so
    that a kernel ignoring or misplacing the scales cannot pass."""
    size = torch.exp(torch.empty(shape[:-1]).uniform_(-2.3, 2.3, generator=gen))
    return torch.randn(shape, generator=gen) * size.unsqueeze(-1)


def make_pool(lens: list[int], num_kv_heads: int, element: torch.dtype, seed: int) -> Pool:
    """Quantized caches, their scales, table, rows, view_lens over permuted slots, and the
    dequantized float64 K/V the references read.

    Slot 0 pads every table row and has NaN scales: a kernel reading it poisons its output.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    num_slots = total + 11
    k, k_scale = quantize(values((num_slots, num_kv_heads, HEAD_DIM), gen), element)
    v, v_scale = quantize(values((num_slots, num_kv_heads, HEAD_DIM), gen), element)
    k_scale[0] = v_scale[0] = float("nan")
    free = torch.randperm(num_slots - 1, generator=gen)[:total] + 1
    num_rows, max_len = len(lens) + 2, max(lens) + 5
    table = torch.zeros(num_rows, max_len, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[: len(lens)].to(torch.int32)
    offset = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = free[offset : offset + n].to(torch.int32)
        offset += n
    lens_t = torch.tensor(lens, dtype=torch.int32)
    pool = (k, v, k_scale, v_scale, table, rows, lens_t)
    return tuple(t.to(DEVICE) for t in pool)


def dequantized(k, v, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(k, k_scale, torch.float64), dequantize(v, v_scale, torch.float64)


def random_subset(lens: list[int], num_kv_heads: int, cap: int, seed: int):
    """Per-head ascending context positions (< L - 1), counts 0, `cap`, L // 3 and -1."""
    gen = torch.Generator().manual_seed(seed)
    subset = torch.zeros(len(lens), num_kv_heads, cap, dtype=torch.int32)
    counts = []
    for s, n in enumerate(lens):
        count = min(n - 1, cap, [0, cap, max(1, n // 3)][s % 3])
        for h in range(num_kv_heads):
            pick = torch.randperm(n - 1, generator=gen)[:count].sort().values
            subset[s, h, :count] = pick.to(torch.int32)
        counts.append(-1 if s % 4 == 3 else count)
    return subset.to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)


def decode_reference(q, kd, vd, table, rows, lens, scale, subset, counts, window):
    """float64 (out [S, Hq, D], probs [S, Hq, max_len]) on the dequantized cache."""
    num_seqs, num_q_heads, _ = q.shape
    num_kv_heads = kd.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    probs = torch.zeros(num_seqs, num_q_heads, table.shape[1], dtype=torch.float64, device=q.device)
    for s in range(num_seqs):
        n = int(lens[s])
        view = table[int(rows[s]), :n].long()
        if subset is None or int(counts[s]) < 0:
            lo = max(0, n - window) if window else 0
            positions = torch.arange(lo, n, device=q.device).expand(num_kv_heads, n - lo)
            k, v = kd[view[lo:]], vd[view[lo:]]
        else:
            sel = subset[s, :, : int(counts[s])].long()  # [Hkv, B]
            k, v = torch_ref.gather_selected(DenseStorage.wrap(kd, vd), view, sel)
            last = torch.full((num_kv_heads, 1), n - 1, device=q.device)
            positions = torch.cat([sel, last], dim=1)  # [Hkv, B + 1]
        qs = q[s : s + 1].double()
        out[s] = torch_ref.attend(qs, k, v, scale)[0]
        kk = k.repeat_interleave(group, dim=1)  # [n', Hq, D]
        p = (torch.einsum("hd,nhd->hn", qs[0], kk) * scale).softmax(dim=-1)  # [Hq, n']
        probs[s].scatter_(1, positions.repeat_interleave(group, dim=0), p)
    return out, probs


def run_decode(
    element, dtype, heads, num_splits, subset_cap=None, scores=False, window=None, seed=0, **kw
):
    """Decode over a quantized pool, checked against the reference; returns the reference
    output, the positional arguments and the scales."""
    num_q_heads, num_kv_heads = heads
    k, v, k_scale, v_scale, table, rows, view_lens = make_pool(
        DECODE_LENS, num_kv_heads, element, seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(DECODE_LENS), num_q_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    scale = HEAD_DIM**-0.5
    subset = counts = None
    if subset_cap is not None:
        subset, counts = random_subset(DECODE_LENS, num_kv_heads, subset_cap, seed)
    out = torch.full_like(q, float("nan"))
    scores_out = None
    if scores:
        scores_out = torch.full(
            (len(DECODE_LENS), num_q_heads, table.shape[1]), float("nan"), device=DEVICE
        )
    args = (q, k, v, table, rows, view_lens, scale, out)
    decode_attention(
        *args,
        subset=subset,
        subset_lens=counts,
        scores_out=scores_out,
        window=window,
        num_splits=num_splits,
        k_scale=k_scale,
        v_scale=v_scale,
        **kw,
    )
    kd, vd = dequantized(k, v, k_scale, v_scale)
    ref, probs = decode_reference(q, kd, vd, table, rows, view_lens, scale, subset, counts, window)
    assert torch.isfinite(out).all(), "output not fully written, or a padding slot was read"
    assert rel_err(out, ref) < TOL[dtype]
    if scores_out is not None:
        assert torch.isfinite(scores_out).all()
        assert rel_err(scores_out, probs) < TOL[dtype]
        for s, n in enumerate(DECODE_LENS):
            assert (scores_out[s, :, n:] == 0).all()
    return ref, args, (k_scale, v_scale)


# -- store ------------------------------------------------------------------------------


def tie_rows(element: torch.dtype) -> torch.Tensor:
    """[2, D] rows whose scale is exactly 1 with elements exactly halfway between two
    representable values (round half to even), subnormal fp8 steps, and zeros."""
    rows = torch.zeros(2, HEAD_DIM)
    if element == torch.int8:
        rows[0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5])
    else:
        ties = [448.0, 1.0625, 8.5, 17.0, 19.0, -(2.0**-10), 3 * 2.0**-10, 2.0**-8]
        rows[0, : len(ties)] = torch.tensor(ties)
    rows[1, :3] = torch.tensor([1.0, 1e-5, -3e-4])
    return rows


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantizes_like_the_reference(element, src_dtype):
    num_tokens, num_kv_heads, num_slots = 23, 3, 40
    gen = torch.Generator().manual_seed(3)
    # k and v as strided slices of one fused buffer, like a QKV projection's output.
    fused = values((num_tokens, 3 * num_kv_heads, HEAD_DIM), gen)
    fused[4] = 0.0  # all-zero rows: scale 1
    fused[5, :2] = tie_rows(element)
    fused[6, num_kv_heads : num_kv_heads + 2] = tie_rows(element)
    fused = fused.to(src_dtype).to(DEVICE)
    k, v = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[[3, 11]] = -1  # CUDA-graph padding rows
    slots = slots.to(DEVICE)
    cache = torch.randint(-100, 100, (4, num_slots, num_kv_heads, HEAD_DIM), generator=gen)
    k_cache, v_cache = (c.to(element).to(DEVICE) for c in cache[:2])
    k_scale, v_scale = torch.rand(2, num_slots, num_kv_heads, generator=gen).to(DEVICE)
    before = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]

    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)

    valid = slots >= 0
    written = slots[valid]
    k_ref, k_scale_ref = quantize(k[valid], element)
    v_ref, v_scale_ref = quantize(v[valid], element)
    bits = torch.uint8 if element == torch.float8_e4m3fn else torch.int8
    assert torch.equal(k_cache[written].view(bits), k_ref.view(bits))  # bit-exact
    assert torch.equal(v_cache[written].view(bits), v_ref.view(bits))
    assert torch.equal(k_scale[written], k_scale_ref)
    assert torch.equal(v_scale[written], v_scale_ref)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for now, old in zip((k_cache, v_cache, k_scale, v_scale), before):
        assert torch.equal(now[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


# -- decode -----------------------------------------------------------------------------


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(element, dtype, num_splits):
    run_decode(element, dtype, (4, 2), num_splits, block_n=16)


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_subset_and_scores(element, num_splits):
    run_decode(element, torch.bfloat16, (4, 2), num_splits, 24, scores=True, seed=5, block_n=16)


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("window", [5, 50])
def test_decode_window_and_scores(element, window):
    run_decode(element, torch.float32, (2, 2), 3, scores=True, window=window, seed=7)


@pytest.mark.parametrize("element", FORMATS)
def test_decode_sequences_fastest_grid_order(element):
    run_decode(element, torch.float32, (4, 2), 3, 24, heads_fastest=False, seed=9)


@pytest.mark.parametrize("which", ["k", "v"])
def test_decode_reads_each_heads_scale(which):
    # Swapping the two KV heads' scales of one buffer must change the result: the kernel
    # reads K and V scales per (slot, head) rather than ignoring or sharing them.
    ref, args, (k_scale, v_scale) = run_decode(torch.int8, torch.float32, (4, 2), 1, block_n=16)
    out = args[-1]
    if which == "k":
        k_scale = k_scale.flip(1).contiguous()
    else:
        v_scale = v_scale.flip(1).contiguous()
    decode_attention(*args, num_splits=1, block_n=16, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, ref) > 100 * TOL[torch.float32]


# -- prefill ----------------------------------------------------------------------------


def run_prefill(element, dtype, heads, window=None, store_chunk=False, **tiles):
    """Chunks over cached prefixes; with `store_chunk` the chunk's K/V reach the cache
    through store_kv (as the backend does) instead of the reference quantizer. A chunk of
    several queries reads its own K/V from k_new/v_new (unquantized), a single query reads
    itself from the cache (the torch reference backend's rule)."""
    num_q_heads, num_kv_heads = heads
    lens = [p + n for p, n in PREFILL_SEQS]
    k, v, k_scale, v_scale, table, rows, view_lens = make_pool(lens, num_kv_heads, element, 11)
    q_lens = [n for _, n in PREFILL_SEQS]
    q_starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(sum(q_lens), num_q_heads, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    k_new = values((sum(q_lens), num_kv_heads, HEAD_DIM), gen).to(dtype).to(DEVICE)
    v_new = values((sum(q_lens), num_kv_heads, HEAD_DIM), gen).to(dtype).to(DEVICE)
    if store_chunk:
        chunk_slots = torch.cat(
            [table[int(rows[s]), p : p + n] for s, (p, n) in enumerate(PREFILL_SEQS)]
        )
        store_kv(k_new, v_new, k, v, chunk_slots, k_scale, v_scale)
    scale = HEAD_DIM**-0.5
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        *(q, k, v, table, rows, q_starts, view_lens, scale, out, max(q_lens)),
        window=window,
        k_scale=k_scale,
        v_scale=v_scale,
        k_new=k_new,
        v_new=v_new,
        **tiles,
    )
    assert torch.isfinite(out).all(), "output not fully written, or a padding slot was read"
    kd, vd = dequantized(k, v, k_scale, v_scale)
    for s, (start, n) in enumerate(zip(q_starts.tolist(), q_lens)):
        view = table[int(rows[s]), : lens[s]].long()
        k_view, v_view = kd[view], vd[view]
        if n > 1:  # the chunk's own rows as computed
            k_view[-n:], v_view[-n:] = k_new[start : start + n], v_new[start : start + n]
        ref = torch_ref.attend(q[start : start + n].double(), k_view, v_view, scale, window)
        assert rel_err(out[start : start + n], ref) < TOL[dtype]


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_cached_prefix(element, dtype):
    run_prefill(element, dtype, (4, 2))


@pytest.mark.parametrize("element", FORMATS)
def test_prefill_small_tiles_after_store(element):
    # 16-key tiles: whole unmasked tiles before the diagonal, chunks stored by the kernel.
    run_prefill(element, torch.bfloat16, (4, 2), store_chunk=True, block_m=16, block_n=16)


@pytest.mark.parametrize("element", FORMATS)
@pytest.mark.parametrize("window", [3, 20])
def test_prefill_window(element, window):
    run_prefill(element, torch.float32, (2, 2), window=window, block_m=16, block_n=16)


# -- argument checks --------------------------------------------------------------------


def bad_scales(num_slots: int, num_kv_heads: int) -> list[tuple[str, dict[str, object]]]:
    """(message fragment, scale keywords) that a quantized cache must refuse."""
    good = torch.ones(num_slots, num_kv_heads, device=DEVICE)
    return [
        ("needs k_scale and v_scale", {}),
        ("needs k_scale and v_scale", dict(k_scale=good)),
        ("must be float32", dict(k_scale=good.half(), v_scale=good)),
        ("must be float32", dict(k_scale=good, v_scale=good[:, :1])),
        ("must be float32", dict(k_scale=good[1:], v_scale=good)),
    ]


def test_bad_scale_arguments_raise():
    k, v, k_scale, v_scale, table, rows, view_lens = make_pool([5, 9], 2, torch.int8, 0)
    num_slots = k.shape[0]
    q = torch.randn(2, 4, HEAD_DIM, device=DEVICE)
    out = torch.empty_like(q)
    q_starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)

    def launches(kc, vc, **sc):
        yield lambda: decode_attention(q, kc, vc, table, rows, view_lens, 0.1, out, **sc)
        yield lambda: prefill_attention(
            q, kc, vc, table, rows, q_starts, view_lens, 0.1, out, 1, **sc
        )
        yield lambda: store_kv(
            q[:, :2], q[:, :2], kc, vc, slots, sc.get("k_scale"), sc.get("v_scale")
        )

    for message, scales in bad_scales(num_slots, 2):
        for launch in launches(k, v, **scales):
            with pytest.raises(ValueError, match=message):
                launch()
    model_dtype = torch.zeros(num_slots, 2, HEAD_DIM, device=DEVICE)
    for launch in launches(model_dtype, model_dtype, k_scale=k_scale, v_scale=v_scale):
        with pytest.raises(ValueError, match="go with an int8 or float8_e4m3fn cache"):
            launch()
    for launch in launches(k, v.view(torch.float8_e4m3fn), k_scale=k_scale, v_scale=v_scale):
        with pytest.raises(ValueError, match="but v_cache is"):
            launch()
    own = dict(k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="needs k_new and v_new"):
        prefill_attention(q, k, v, table, rows, q_starts, view_lens, 0.1, out, 1, **own)
    k_new = torch.zeros(2, 2, HEAD_DIM, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_new must be \[2, 2, "):
        prefill_attention(
            *(q, k, v, table, rows, q_starts, view_lens, 0.1, out, 1),
            **own,
            k_new=k_new[:1],
            v_new=k_new,
        )
