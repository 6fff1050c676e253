"""The reference backend's padded decode over every sequence at once equals its
per-sequence attention (`attend` over each gathered view)."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.attention import torch_ref
from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.kv.dense import DenseStorage


class _NoSparse:
    def wants_scores(self, layer: int, i: int) -> int:
        return 0


def _batch(tables: torch.Tensor, lens: list[int]) -> ForwardBatch:
    s = len(lens)
    batch = ForwardBatch.__new__(ForwardBatch)  # only the fields the decode path reads
    batch.tables, batch.view_lens, batch.rows = tables, [lens], list(range(s))
    batch.rows_t = torch.arange(s, dtype=torch.int32)
    batch.q_lens, batch.q_starts = [1] * s, list(range(s))
    batch.sparse = _NoSparse()  # type: ignore[assignment]
    batch._padded_views = {}
    return batch


@pytest.mark.parametrize("max_read", [torch_ref.MAX_READ_TOKENS, 80, 1])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
def test_padded_decode_equals_per_sequence(window, heads, max_read):
    """Whole batch at once, in groups of two sequences (80 entries of width 40), or one
    at a time (a bound below one view still reads a whole sequence)."""
    torch.manual_seed(0)
    hq, hkv, d, slots = *heads, 16, 200
    lens = [1, 9, 37, 20]
    storage = DenseStorage.wrap(
        torch.randn(slots, hkv, d).double(), torch.randn(slots, hkv, d).double()
    )
    tables = torch.zeros(1, len(lens), 40, dtype=torch.int32)
    perm = torch.randperm(slots)
    for i, n in enumerate(lens):  # views in scattered slots; past a view's end: garbage ids
        tables[0, i, :n] = perm[i * 40 : i * 40 + n].int()
        tables[0, i, n:] = 199
    q = torch.randn(len(lens), hq, d).double()
    batch = _batch(tables, lens)
    assert torch_ref._batched_decode(0, batch, window)
    got = torch_ref.attend_decode_batch(q, storage, batch, 0, 0.25, window, max_read)
    for i, n in enumerate(lens):
        k, v = storage.read(tables[0, i, :n].long())
        want = torch_ref.attend(q[i : i + 1], k, v, 0.25, window)
        assert torch.allclose(got[i : i + 1], want, atol=1e-12), i


def test_rows_asking_for_scores_take_the_per_sequence_path():
    batch = _batch(torch.zeros(1, 2, 4, dtype=torch.int32), [2, 3])

    class Scores(_NoSparse):
        def wants_scores(self, layer: int, i: int) -> int:
            return int(i == 1)

    batch.sparse = Scores()  # type: ignore[assignment]
    assert not torch_ref._batched_decode(0, batch, None)
    assert torch_ref._batched_decode(0, batch, 4)  # sliding layers never score
    batch.q_lens = [1, 2]
    batch.sparse = _NoSparse()  # type: ignore[assignment]
    assert not torch_ref._batched_decode(0, batch, None)
