"""The MLA decode kernel (attention/triton/decode_mla.py) and the latent row store
against the torch reference over the same latent storage (kv/latent.py): ragged views,
several splits, head blocks, subsets, scores, int8 / fp8 rows. CPU under the Triton
interpreter (small R and P; the kernel is the same at R 512, P 64) or CUDA."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention import torch_ref  # noqa: E402
from sparsevllm.attention.triton.decode_mla import decode_mla_attention  # noqa: E402
from sparsevllm.attention.triton.kv_store import store_rows  # noqa: E402
from sparsevllm.kv.latent import LatentStorage  # noqa: E402
from sparsevllm.kv.layout import latent_layout  # noqa: E402
from sparsevllm.kv.registry import create_storage, get_format  # noqa: E402

RANK, ROPE = 32, 16
LENS = [1, 5, 37, 70]  # ragged, one of a single token, tails not a whole tile
TOL = {"auto": 2e-5, "int8": 2e-5, "fp8_e4m3": 2e-5}
SCALE = 0.3


def make_pool(
    lens: list[int],
    fmt: str,
    dtype: torch.dtype = torch.float32,
    rank: int = RANK,
    rope: int = ROPE,
    seed: int = 0,
) -> tuple[LatentStorage, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent storage holding the views of `lens` at permuted slots, the table (spare
    rows, NaN-free padding at slot 0), rows and view lengths."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    slots = 1 + torch.randperm(total + 20, generator=gen)[:total]
    storage = create_storage(get_format(fmt), total + 21, latent_layout(rank, rope), dtype, DEVICE)
    x = torch.randn(total, 1, rank + rope, generator=gen).to(DEVICE, dtype)
    storage.store(x, x[..., :rank], slots.to(DEVICE))
    width = max(lens) + 3
    table = torch.zeros(len(lens) + 2, width, dtype=torch.int32)
    rows = torch.tensor([2 + i for i in range(len(lens))][::-1], dtype=torch.int32) % len(table)
    offset = 0
    for row, n in zip(rows.tolist(), lens):
        table[row, :n] = slots[offset : offset + n]
        offset += n
    lens_t = torch.tensor(lens, dtype=torch.int32)
    assert isinstance(storage, LatentStorage)
    return storage, table.to(DEVICE), rows.to(DEVICE), lens_t.to(DEVICE)


def queries(
    num_seqs: int, heads: int, dtype: torch.dtype, rank: int = RANK, rope: int = ROPE
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(num_seqs, heads, rank + rope, generator=gen).to(DEVICE, dtype)


def reference(storage, table, rows, lens, q, subset=None, subset_lens=None, scale=SCALE):
    """torch_ref's single-query attention per sequence (its own selection rules) and
    its probabilities over view positions `[S, H, width]` (0 where not read)."""
    out = q.new_empty(*q.shape[:2], storage.v.shape[-1])
    probs = torch.zeros(*q.shape[:2], table.shape[1], device=q.device)
    for i, (row, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        view = table[row, :n].long()
        positions, key_mask = None, None
        if subset is not None:
            positions, key_mask = torch_ref._row_selection(subset[i].cpu(), subset_lens[i].cpu())
        if positions is None:
            k, v = storage.read(view)
            read = torch.arange(n)
        else:
            positions = positions.to(q.device)
            k, v = torch_ref.gather_selected(storage, view, positions[0])
            read = torch.cat([positions[0].cpu(), torch.tensor([n - 1])])
        out[i] = torch_ref.attend(q[i : i + 1], k, v, scale, key_mask=key_mask)[0]
        mass = torch_ref.attention_mass(q[i : i + 1].float(), k.float(), scale)  # [H, len]
        probs[i][:, read.to(q.device)] = mass
    return out, probs


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("heads,num_splits", [(4, 1), (16, 3), (20, 2)])
def test_decode_matches_reference(fmt, heads, num_splits):
    """Heads 20 with block_h 16: two head blocks, the second mostly padding."""
    storage, table, rows, lens = make_pool(LENS, fmt)
    q = queries(len(LENS), heads, torch.float32)
    out = q.new_full((len(LENS), heads, RANK), float("nan"))
    decode_mla_attention(
        q, storage.k, table, rows, lens, SCALE, out,
        kv_scale=storage.k_scale, num_splits=num_splits, block_h=16, block_n=16,
    )  # fmt: skip
    want, _ = reference(storage, table, rows, lens, q)
    torch.testing.assert_close(out, want, atol=TOL[fmt], rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_model_dtype_16bit(dtype):
    storage, table, rows, lens = make_pool(LENS, "auto", dtype, rank=64)
    q = queries(len(LENS), 8, dtype, rank=64)
    out = torch.empty(len(LENS), 8, 64, dtype=dtype, device=DEVICE)
    decode_mla_attention(q, storage.k, table, rows, lens, SCALE, out, num_splits=2, block_n=16)
    # The reference over the same stored values in float32.
    wide = LatentStorage(get_format("auto"), storage.num_slots, latent_layout(64, ROPE),
                         torch.float32, DEVICE)  # fmt: skip
    wide.k.copy_(storage.k.float())
    want, _ = reference(wide, table, rows, lens, q.float())
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_decode_scores(fmt, num_splits):
    storage, table, rows, lens = make_pool(LENS, fmt)
    q = queries(len(LENS), 8, torch.float32)
    out = torch.empty(len(LENS), 8, RANK, device=DEVICE)
    scores = torch.full((len(LENS), 8, table.shape[1]), float("nan"), device=DEVICE)
    decode_mla_attention(
        q, storage.k, table, rows, lens, SCALE, out,
        kv_scale=storage.k_scale, scores_out=scores, num_splits=num_splits, block_n=16,
    )  # fmt: skip
    want, probs = reference(storage, table, rows, lens, q)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(scores, probs, atol=1e-6, rtol=1e-4)


def _subset(lens: list[int], picks: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, 1, B] ascending positions (from a seeded permutation) and [S] counts; a count
    None reads the whole view (-1)."""
    width = max(lens)
    subset = torch.zeros(len(lens), 1, width, dtype=torch.int32)
    counts = []
    gen = torch.Generator().manual_seed(3)
    for i, (n, k) in enumerate(zip(lens, picks)):
        if k is None:
            counts.append(-1)
            continue
        chosen = torch.randperm(max(n - 1, 1), generator=gen)[:k].sort().values
        subset[i, 0, : len(chosen)] = chosen.int()
        counts.append(len(chosen) if n > 1 else 0)
    return subset.to(DEVICE), torch.tensor(counts, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
def test_decode_subset_and_scores(fmt, num_splits):
    """Per sequence: no subset entry (only its own token), a whole view (-1), a few
    picks, many picks; scores are nonzero only at the positions read."""
    storage, table, rows, lens = make_pool(LENS, fmt)
    subset, counts = _subset(LENS, [0, None, 9, 40])
    q = queries(len(LENS), 8, torch.float32)
    out = torch.empty(len(LENS), 8, RANK, device=DEVICE)
    scores = torch.empty(len(LENS), 8, table.shape[1], device=DEVICE)
    decode_mla_attention(
        q, storage.k, table, rows, lens, SCALE, out, subset=subset, subset_lens=counts,
        kv_scale=storage.k_scale, scores_out=scores, num_splits=num_splits, block_n=16,
    )  # fmt: skip
    want, probs = reference(storage, table, rows, lens, q, subset, counts)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(scores, probs, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
def test_full_width_rows_default_config(fmt):
    """R 512, P 64 (every real MLA model's row) with 20 heads and the default tiles and
    splits (one block of 32 heads), on short views: the same kernel the GPU runs."""
    storage, table, rows, lens = make_pool([70, 1, 33], fmt, rank=512, rope=64)
    q = queries(3, 20, torch.float32, 512, 64)
    out = torch.empty(3, 20, 512, device=DEVICE)
    decode_mla_attention(q, storage.k, table, rows, lens, 0.05, out, kv_scale=storage.k_scale)
    want, _ = reference(storage, table, rows, lens, q, scale=0.05)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_padding_row_reads_nothing():
    """A view of length 0 (a CUDA-graph padding row) gives zeros, with or without splits."""
    storage, table, rows, lens = make_pool([4, 9], "auto")
    lens = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    q = queries(2, 4, torch.float32)
    for splits in (1, 2):
        out = torch.full((2, 4, RANK), float("nan"), device=DEVICE)
        decode_mla_attention(q, storage.k, table, rows, lens, SCALE, out, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1]).all()


def test_rejects_bad_shapes():
    storage, table, rows, lens = make_pool([4], "int8")
    q = queries(1, 4, torch.float32)
    out = torch.empty(1, 4, RANK, device=DEVICE)
    with pytest.raises(ValueError, match="kv_scale"):
        decode_mla_attention(q, storage.k, table, rows, lens, SCALE, out)
    with pytest.raises(ValueError, match="bad shapes"):
        decode_mla_attention(
            q, storage.k, table, rows, lens, SCALE, out[:, :3], kv_scale=storage.k_scale
        )


@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3"])
def test_store_rows_matches_latent_store(fmt):
    """The Triton row store writes the storage's bytes and scales (skipping slot -1)."""
    a = make_pool([3], fmt)[0]
    b = make_pool([3], fmt)[0]
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 1, RANK + ROPE, generator=gen) * 3).to(DEVICE)
    slots = torch.tensor([4, 9, -1, 0, 11, 2], device=DEVICE)
    a.store(x, x[..., :RANK], slots)
    store_rows(x, b.k, slots, b.k_scale)
    assert torch.equal(a.k.float(), b.k.float())
    if fmt != "auto":
        assert torch.equal(a.k_scale, b.k_scale)


ON_GPU = DEVICE.type == "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _full_size(fmt: str, heads: int, lens: list[int]):
    """GLM-4.7-Flash's latent (R 512, P 64) in bf16, and the float32 reference over the
    same stored values (a float32 copy of the rows, the scales shared)."""
    storage, table, rows, lens_t = make_pool(lens, fmt, torch.bfloat16, 512, 64)
    q = queries(len(lens), heads, torch.bfloat16, 512, 64)
    wide = LatentStorage(get_format(fmt), storage.num_slots, latent_layout(512, 64),
                         torch.float32, DEVICE)  # fmt: skip
    wide.k.copy_(storage.k)
    if wide.k_scale is not None:
        wide.k_scale.copy_(storage.k_scale)
    return storage, wide, table, rows, lens_t, q


@pytest.mark.skipif(not ON_GPU, reason="full-size shapes are slow in the interpreter")
@pytest.mark.parametrize("fmt", ["auto", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("heads", [20, 128])
def test_full_size_shapes_bf16(fmt, heads):
    """GLM-4.7-Flash's 20 heads and DeepSeek-V3's 128, default tiles and splits."""
    storage, wide, table, rows, lens, q = _full_size(fmt, heads, [5000, 33, 1, 2049])
    out = torch.empty(4, heads, 512, dtype=torch.bfloat16, device=DEVICE)
    scores = torch.empty(4, heads, table.shape[1], device=DEVICE)
    decode_mla_attention(
        q, storage.k, table, rows, lens, 0.07, out, kv_scale=storage.k_scale, scores_out=scores
    )
    want, probs = reference(wide, table, rows, lens, q.float(), scale=0.07)
    assert rel_err(out, want) < 2e-2
    assert rel_err(scores, probs) < 2e-2


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    storage, wide, table, rows, lens, q = _full_size("auto", 20, [300, 4000, 17, 9000])
    out = torch.empty(4, 20, 512, dtype=torch.bfloat16, device=DEVICE)
    scores = torch.empty(4, 20, table.shape[1], device=DEVICE)

    def step() -> None:
        decode_mla_attention(q, storage.k, table, rows, lens, 0.07, out, scores_out=scores)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # New data and shorter views in the same buffers, then replay.
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([299, 1, 9, 8191], dtype=torch.int32, device=DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    want, probs = reference(wide, table, rows, lens, q.float(), scale=0.07)
    assert rel_err(out, want) < 2e-2
    assert rel_err(scores, probs) < 2e-2
