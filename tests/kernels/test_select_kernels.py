"""Kernels of the batched sparse selection vs their torch definitions.

Runs on CUDA, or on CPU under the Triton interpreter (TRITON_INTERPRET=1); skips otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip(
        "needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter", allow_module_level=True
    )

from sparsevllm.attention.triton.quest import quest_batch_scores  # noqa: E402
from sparsevllm.sparse.quest import page_scores  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((4, 4), 80)])
def test_quest_batch_scores_match_page_scores(dtype, heads, head_dim):
    num_q_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(0)
    capacity, num_pages = 50, 45  # 45 > one block of pages: two blocks per row
    bounds = torch.randn(capacity, 2, num_kv_heads, head_dim, generator=g).sort(dim=1).values
    bounds = bounds.to(dtype)
    table = torch.randint(0, capacity, (4, num_pages), generator=g, dtype=torch.int32)
    table[1] = -1  # entries past `full` are never read
    full = torch.tensor([45, 0, 33, 1], dtype=torch.int32)
    q = torch.randn(4, num_q_heads, head_dim, generator=g)
    qg = q.view(4, num_kv_heads, -1, head_dim)
    q_pos, q_neg = qg.clamp(min=0).sum(2), qg.clamp(max=0).sum(2)  # [S, Hkv, D]
    args = (q_pos, q_neg, bounds, table, full)
    got = quest_batch_scores(*(t.to(DEVICE) for t in args)).cpu()
    assert got.shape == (4, num_kv_heads, num_pages) and got.dtype == torch.float32
    for s in range(4):
        n = int(full[s])
        ids = table[s, :n].long()
        ref = page_scores(
            q[s].double(), bounds[ids, 0].double(), bounds[ids, 1].double(), num_kv_heads
        )
        torch.testing.assert_close(got[s, :, :n].double(), ref, rtol=1e-5, atol=1e-4)
        assert torch.isneginf(got[s, :, n:]).all()
