"""The expanded form of MLA prefill equals the absorbed form (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.attention.torch_ref import attend

HEADS, RANK, ROPE, NOPE, VDIM = 3, 16, 8, 12, 10


def _chunk(n: int, length: int) -> tuple[LatentExpansion, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 1000 + length)
    queries = torch.randn(n + 2, HEADS, NOPE + ROPE, generator=gen)  # 2 rows of others
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=gen) * RANK**-0.5
    w_uv = torch.randn(HEADS, VDIM, RANK, generator=gen) * RANK**-0.5
    rows = torch.randn(length, 1, RANK + ROPE, generator=gen)
    q_nope, q_pe = queries.split([NOPE, ROPE], dim=-1)
    exp = LatentExpansion(q_nope, q_pe, w_uk, w_uv)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    return exp, rows, q_abs


@pytest.mark.parametrize(("n", "length"), [(5, 5), (4, 9), (7, 30), (1, 6)])
def test_expanded_equals_absorbed(n: int, length: int) -> None:
    exp, rows, q_abs = _chunk(n, length)
    scale = 0.3
    # The chunk is the batch's queries 1 .. n (one query of another sequence before it).
    want = exp.values(attend(q_abs[1 : 1 + n], rows, rows[..., :RANK], scale))
    got = exp.attend(1, n, rows, scale)
    assert got.shape == (n, HEADS, VDIM)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_choice_off_cuda_counts_flops() -> None:
    # GLM-4.7-Flash's shapes on the CPU: the up-projection (2 R H (Dn + Dv) per row) is
    # paid back only by many queries per row.
    heads, rank, rope, nope, vdim = 20, 512, 64, 192, 256
    exp = LatentExpansion(
        torch.empty(1, heads, nope),
        torch.empty(1, heads, rope),
        torch.empty(heads, nope, rank),
        torch.empty(heads, vdim, rank),
    )
    assert not exp.worth(15, 15)  # below MIN_EXPANDED_QUERIES
    assert not exp.worth(16, 32768)  # 16 queries do not pay for 32K up-projected rows
    assert exp.worth(2048, 2048) and exp.worth(2048, 32768)
    assert not exp.worth(2048, 2**28)  # the transient K and V would exceed the budget
