"""The fused MoE kernel against the torch reference (a loop over the experts)."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention.triton.moe import align_by_expert, fused_moe  # noqa: E402
from sparsevllm.layers.moe import reference_experts, route  # noqa: E402


def make_experts(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


def run_both(x, gate_up, down, weights, ids, **kw):
    want = reference_experts(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    got = fused_moe(
        x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), **kw
    ).cpu()
    assert got.shape == x.shape and got.dtype == x.dtype
    return got, want


@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_fused_moe_matches_reference_float32(num_tokens):
    num_experts, top_k, hidden, inter = 8, 2, 96, 48  # sizes off the block multiples
    gate_up, down = make_experts(num_experts, hidden, inter, torch.float32)
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = route(logits, top_k, normalize=True)
    got, want = run_both(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_uneven_loads_and_idle_experts():
    """Most tokens on one expert (several blocks of it), a few on another, the rest of
    the experts idle: the padding, the block-to-expert map and the idle runs."""
    num_experts, top_k, hidden, inter = 6, 2, 64, 32
    gate_up, down = make_experts(num_experts, hidden, inter, torch.float32, seed=1)
    t = 37
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, hidden, generator=g)
    ids = torch.zeros(t, top_k, dtype=torch.long)
    ids[:, 0] = 4  # every token: expert 4 (37 rows, three 16-row blocks)
    ids[:, 1] = 1  # and expert 1 ...
    ids[30:, 1] = 5  # ... except the last seven: expert 5; experts 0, 2, 3 get nothing
    weights = torch.rand(t, top_k, generator=g)
    got, want = run_both(x, gate_up, down, weights, ids, block_sizes=(16, 32, 32))
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "torch"])
def test_alignment_groups_rows_by_expert(use_kernel):
    ids = torch.tensor([[3, 0], [3, 1], [3, 0], [1, 3], [0, 3]])  # 2 idle, 3 in two blocks
    sorted_ids, block_expert = align_by_expert(ids.to(DEVICE), 4, 4, use_kernel=use_kernel)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    num_assign = ids.numel()
    flat = ids.reshape(-1)
    assert block_expert.numel() * 4 == sorted_ids.numel()
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[4 * b : 4 * b + 4].tolist()
        real = [r for r in rows if r < num_assign]
        if e == 4:  # past the last run: padding only
            assert not real
            continue
        assert real and all(flat[r] == e for r in real)
        assert rows == real + [num_assign] * (4 - len(real))  # padding at the run's end
        seen += real
    assert sorted(seen) == list(range(num_assign))  # every assignment exactly once
    assert [e for e in block_expert.tolist() if e < 4] == [0, 1, 3, 3]  # sorted, 2 skipped


@pytest.mark.parametrize("case", ["uniform", "one_hot_expert", "few"])
def test_alignment_kernel_equals_torch(case):
    """The one-launch alignment gives the torch ops' tensors exactly: runs longer than a
    kernel chunk (32 assignments, 32 blocks), idle experts, and fewer rows than experts."""
    g = torch.Generator().manual_seed(7)
    num_experts, block_m = 12, 4
    if case == "uniform":
        ids = torch.randint(0, num_experts, (150, 2), generator=g)
    elif case == "one_hot_expert":  # 200 rows of expert 9: 50 blocks of it
        ids = torch.full((100, 2), 9)
        ids[::7, 1] = torch.randint(0, 5, (15,), generator=g)
    else:
        ids = torch.tensor([[11, 2]])
    got = align_by_expert(ids.to(DEVICE), num_experts, block_m, use_kernel=True)
    want = align_by_expert(ids.to(DEVICE), num_experts, block_m, use_kernel=False)
    for g_t, w_t in zip(got, want):
        assert torch.equal(g_t.cpu(), w_t.cpu())


def test_fused_moe_bfloat16():
    num_experts, top_k, hidden, inter = 16, 4, 128, 64
    gate_up, down = make_experts(num_experts, hidden, inter, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, hidden, generator=g).to(torch.bfloat16)
    weights, ids = route(torch.randn(24, num_experts, generator=g), top_k, normalize=False)
    got, want = run_both(x, gate_up, down, weights.to(torch.bfloat16), ids)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 2e-2, err


def test_prefill_block_sizes_and_bad_shapes():
    num_experts, top_k, hidden, inter = 4, 2, 64, 32
    gate_up, down = make_experts(num_experts, hidden, inter, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(150, hidden, generator=g)  # 75 rows per expert: the 64-row blocks
    weights, ids = route(torch.randn(150, num_experts, generator=g), top_k, normalize=True)
    got, want = run_both(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bad expert shapes"):
        fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down[:, :, :16].to(DEVICE), weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), weights[:5], ids)


def test_bench_moe_reports_every_candidate(monkeypatch):
    """`bench moe`'s per-token-count report on tiny shapes (timers replaced: the report's
    assembly and the block-size sweep, not the timings, are under test)."""
    import time

    import sparsevllm.bench.moe as bench_moe

    def once_ms(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(bench_moe, "_median_ms", once_ms)
    monkeypatch.setattr(bench_moe, "_graph_ms", once_ms)
    shapes = dict(hidden=64, intermediate=32, experts=16, top_k=4, normalize=True)
    gate_up, down = make_experts(16, 64, 32, torch.float32, seed=8)
    row = bench_moe.bench_tokens(shapes, (gate_up.to(DEVICE), down.to(DEVICE)), 8, 1e12)
    assert row["rel_err"] < 1e-5 and 4 <= row["active_experts"] <= 16
    assert row["auto_block_sizes"] == "16x64x128"
    small = [c for c in bench_moe.CANDIDATE_BLOCK_SIZES if c[0] == 16 and c != (16, 64, 128)]
    assert sorted(row["block_sizes_ms"]) == sorted("x".join(map(str, c)) for c in small)
    # A candidate the device cannot run (on an H200, float32 tiles past its shared
    # memory) is reported with the reason, not dropped; the others are timed.
    timed = [v for v in row["block_sizes_ms"].values() if isinstance(v, float)]
    failed = [v for v in row["block_sizes_ms"].values() if not isinstance(v, float)]
    assert timed and all(v.startswith("OutOfResources") for v in failed)
