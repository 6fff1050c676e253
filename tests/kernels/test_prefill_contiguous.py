"""The prefill kernel's one-run path: views held in consecutive slots are addressed as
first slot + position (TMA tiles on Hopper), the others through the slot table; both
against a float64 reference, in one launch. Every slot outside the views is NaN, so a
read past a view's end poisons the output.

Runs on CUDA, or on CPU under the Triton interpreter (TRITON_INTERPRET=1); skips otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton is not installed", allow_module_level=True)
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs a CUDA GPU, or TRITON_INTERPRET=1", allow_module_level=True)

from sparsevllm.attention import torch_ref  # noqa: E402
from sparsevllm.attention.backend import contiguous_view_starts  # noqa: E402
from sparsevllm.attention.triton import prefill_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"


def build_views(lens: list[int], runs: list[bool], heads: int, dim: int, dtype: torch.dtype):
    """Caches whose non-view slots are NaN; view i is one run of slots when runs[i], else
    a permutation of a run with its first two slots swapped (one run except for them)."""
    gen = torch.Generator().manual_seed(7)
    num_slots = sum(lens) + 64 * len(lens) + 64
    k = torch.full((num_slots, heads, dim), float("nan"))
    v = torch.full((num_slots, heads, dim), float("nan"))
    table = torch.zeros(len(lens) + 2, max(lens) + 9, dtype=torch.int32)
    rows = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)].to(torch.int32)
    start = 40
    for row, n, run in zip(rows.tolist(), lens, runs):
        slots = torch.arange(start, start + n, dtype=torch.int32)
        if not run and n > 1:
            slots[[0, 1]] = slots[[1, 0]]
        table[row, :n] = slots
        k[slots.long()] = torch.randn(n, heads, dim, generator=gen)
        v[slots.long()] = torch.randn(n, heads, dim, generator=gen)
        start += n + 64  # NaN slots between views
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = (k.to(dtype), v.to(dtype), table, rows, lens_t)
    return tuple(t.to(DEVICE) for t in out)


def plain_starts(table: torch.Tensor, rows: torch.Tensor, lens: list[int]) -> list[int]:
    starts = []
    for row, n in zip(rows.tolist(), lens):
        slots = table[row, :n].tolist()
        starts.append(slots[0] if slots == list(range(slots[0], slots[0] + n)) else -1)
    return starts


SEQS = [(0, 1), (5, 7), (0, 63), (70, 64), (3, 130), (62, 66), (63, 5)]
SEQS_GPU = SEQS + [(1000, 3000), (0, 4100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 50])
def test_one_run_views_match_reference(dtype, window):
    seqs = SEQS_GPU if ON_GPU and dtype == torch.bfloat16 else SEQS
    lens = [p + n for p, n in seqs]
    runs = [i % 3 != 1 for i in range(len(seqs))]  # two of three views are one run
    k, v, table, rows, view_lens = build_views(lens, runs, 2, 64, dtype)
    starts = contiguous_view_starts(table, rows, view_lens, max(lens))
    assert starts.tolist() == plain_starts(table.cpu(), rows.cpu(), lens)
    assert sum(s >= 0 for s in starts.tolist()) == sum(
        runs[i] or lens[i] == 1 for i in range(len(lens))
    )
    q_lens = [n for _, n in seqs]
    q_starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(q_lens), 8, 64, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, k, v, table, rows, q_starts, view_lens, 0.125, out, max(q_lens),
        window=window, contig_starts=starts,
    )  # fmt: skip
    assert torch.isfinite(out).all(), "a view read a NaN slot, or rows were left unwritten"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    kd, vd = k.double(), v.double()
    for s, (start, n) in enumerate(zip(q_starts.tolist(), q_lens)):
        view = table[int(rows[s]), : lens[s]].long()
        ref = torch_ref.attend(q[start : start + n].double(), kd[view], vd[view], 0.125, window)
        err = (out[start : start + n].double() - ref).norm() / ref.norm()
        assert err < tol, (s, float(err))


def test_starts_ignore_slots_past_the_view():
    # A view is one run even when the table row holds other slots past its end.
    table = torch.tensor([[4, 5, 6, 0, 9], [8, 9, 3, 4, 5]], dtype=torch.int32)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    starts = contiguous_view_starts(table, rows, torch.tensor([3, 2], dtype=torch.int32), 3)
    assert starts.tolist() == [4, 8]
    starts = contiguous_view_starts(table, rows, torch.tensor([4, 3], dtype=torch.int32), 4)
    assert starts.tolist() == [-1, -1]
