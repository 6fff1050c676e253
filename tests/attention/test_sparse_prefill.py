"""Block-sparse prefill's selection rule (attention/sparse_prefill.py) against a plain
loop over blocks, and the masked attention it defines."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.attention import sparse_prefill as sp
from sparsevllm.attention import torch_ref


def loop_selection(mass: torch.Tensor, q_len: int, view_len: int, cfg: sp.PrefillSparsity):
    """The rule, one block at a time: per KV head a set of key blocks per query block."""
    bm, bn = cfg.block_m, cfg.block_n
    hkv, r, num_kb = mass.shape
    out = []
    for h in range(hkv):
        vertical = [float(mass[h, :, b].sum()) for b in range(num_kb)]
        slash = [0.0] * num_kb
        for i in range(r):
            diag = (view_len - r + i) // bn
            for b in range(diag + 1):
                slash[diag - b] += float(mass[h, i, b])
        cols = sorted(range(1, num_kb), key=lambda b: -vertical[b])[: cfg.vertical_blocks]
        offs = sorted(range(2, num_kb), key=lambda o: -slash[o])[: cfg.slash_blocks]
        cols_kept, offs_kept = {0, *cols}, {0, 1, *offs}
        per_block = []
        for mb in range(-(-q_len // bm)):
            first = view_len - q_len + mb * bm
            last = view_len - q_len + min((mb + 1) * bm, q_len) - 1
            keep = set()
            for b in range(last // bn + 1):
                rows = range(first // bn, last // bn + 1)
                if b in cols_kept or any(rb - b in offs_kept for rb in rows):
                    keep.add(b)
            per_block.append(sorted(keep))
        out.append(per_block)
    return out


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.integers(0, 90),
    q_len=st.integers(1, 70),
    hkv=st.integers(1, 3),
    vertical=st.integers(0, 4),
    slash=st.integers(0, 4),
    block=st.sampled_from([(8, 4), (8, 8), (16, 4), (4, 4)]),
    seed=st.integers(0, 2**16),
)
def test_selection_matches_a_loop(prefix, q_len, hkv, vertical, slash, block, seed):
    bm, bn = block
    view_len = prefix + q_len
    cfg = sp.PrefillSparsity(1, vertical, slash, 1, block_m=bm, block_n=bn)
    gen = torch.Generator().manual_seed(seed)
    r = min(q_len, 5)
    num_kb = -(-view_len // bn)
    # Distinct random masses (no ties for topk to break differently); causality does not
    # matter to the rule, so any positive values do.
    mass = torch.rand(hkv, r, num_kb, generator=gen, dtype=torch.float64)
    count, index = sp.select_blocks(mass, q_len, view_len, cfg)
    want = loop_selection(mass, q_len, view_len, cfg)
    assert count.dtype == index.dtype == torch.int32
    assert index.shape[-1] == cfg.max_blocks(view_len)
    for h in range(hkv):
        for mb, blocks in enumerate(want[h]):
            n = int(count[h, mb])
            assert index[h, mb, :n].tolist() == blocks


def test_block_mass_is_the_pooled_softmax():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(45, 2, 16, generator=gen, dtype=torch.float64)
    mass = sp.block_mass_reference(q, k, 0.25, 8)
    probs = torch_ref.attention_mass(q, k, 0.25)  # [Hq, L] summed over the rows
    per_kv = probs.view(2, 2, 45).sum(1)  # [Hkv, L]
    pooled = torch.nn.functional.pad(per_kv, (0, 3)).view(2, 6, 8).sum(-1)
    assert mass.shape == (2, 6, 6)
    torch.testing.assert_close(mass.sum(1), pooled)
    torch.testing.assert_close(mass.sum(-1), torch.full((2, 6), 2.0))  # G = 2 heads


def test_covering_selection_is_dense_attention():
    gen = torch.Generator().manual_seed(1)
    n, length = 50, 83
    q = torch.randn(n, 4, 16, generator=gen)
    k = torch.randn(length, 2, 16, generator=gen)
    v = torch.randn(length, 2, 16, generator=gen)
    cfg = sp.PrefillSparsity(1, 100, 100, 8, block_m=16, block_n=8)
    count, index = sp.estimate_reference(q, k, 0.25, cfg)
    out = sp.attend_block_sparse(q, k, v, 0.25, count, index, 16, 8)
    torch.testing.assert_close(out, torch_ref.attend(q, k, v, 0.25))


def test_sparse_selection_masks_blocks():
    gen = torch.Generator().manual_seed(2)
    n, length = 64, 256
    q = torch.randn(n, 2, 16, generator=gen)
    k = torch.randn(length, 1, 16, generator=gen)
    v = torch.randn(length, 1, 16, generator=gen)
    cfg = sp.PrefillSparsity(1, 1, 1, 8, block_m=16, block_n=8)
    count, index = sp.estimate_reference(q, k, 0.25, cfg)
    mask = sp.block_sparse_mask(count, index, n, length, 16, 8)[0]  # [n, L]
    assert mask[:, :8].all()  # the sink, for every query
    assert mask[torch.arange(n), torch.arange(n) + length - n].all()  # each sees itself
    assert mask.sum() < torch_ref.causal_mask(n, length, q.device).sum() / 2
    assert 0 < sp.density(count, n, length, cfg) < 0.5
    out = sp.attend_block_sparse(q, k, v, 0.25, count, index, 16, 8)
    # The same attention with the mask built by hand.
    logits = torch.einsum("nhd,ld->hnl", q, k[:, 0]) * 0.25
    probs = logits.masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, torch.einsum("hnl,ld->nhd", probs, v[:, 0]))


def test_applies_and_bounds():
    cfg = sp.PrefillSparsity(min_len=1000, last_q=64)
    assert cfg.applies(65, 1000) and not cfg.applies(64, 5000) and not cfg.applies(500, 999)
    assert sp.PrefillSparsity().max_blocks(131072) == 1 + 24 + 14 * 3
    assert sp.PrefillSparsity().max_blocks(300) == 5


def test_reference_in_pieces_equals_one_piece(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n, length = 70, 150
    q = torch.randn(n, 4, 16, generator=gen)
    k = torch.randn(length, 2, 16, generator=gen)
    v = torch.randn(length, 2, 16, generator=gen)
    cfg = sp.PrefillSparsity(1, 2, 1, 8, block_m=16, block_n=8)
    count, index = sp.estimate_reference(q, k, 0.25, cfg)
    whole = sp.attend_block_sparse(q, k, v, 0.25, count, index, 16, 8)
    monkeypatch.setattr(sp, "REFERENCE_MASK_ELEMENTS", 4 * length * 16 * 2)  # 2 blocks a piece
    torch.testing.assert_close(sp.attend_block_sparse(q, k, v, 0.25, count, index, 16, 8), whole)
