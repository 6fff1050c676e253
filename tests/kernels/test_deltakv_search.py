"""DeltaKV's center search kernel (attention/triton/deltakv_search.py) against the torch
reference: the centers' vectors built by the codec (`TokenCodec.vectors`, keys turned
back to pre-RoPE) and the squared distance written out, on full rows in shuffled slots
of a `DeltaKVStorage`; and the codec's search over tokens that share their sequence's
candidates (`TokenCodec.center_distances`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention.triton.deltakv_search import center_distances  # noqa: E402
from sparsevllm.deltakv.compressor import DeltaKVCompressor  # noqa: E402
from sparsevllm.deltakv.rope import rope_table  # noqa: E402
from sparsevllm.deltakv.shard import CompressorShard  # noqa: E402
from sparsevllm.deltakv.spec import DeltaKVSpec  # noqa: E402
from sparsevllm.kv.deltakv import DeltaKVStorage, deltakv_format  # noqa: E402
from sparsevllm.sparse.deltakv_codec import CenterCandidates, TokenCodec  # noqa: E402

NREF = 4
TOL = 1e-5  # of the distances' scale: float32 sums of C squared differences


@dataclasses.dataclass
class Case:
    storage: DeltaKVStorage
    codec: TokenCodec
    xt: torch.Tensor  # [G, C] float32
    table: torch.Tensor  # [G, m] slots
    c_pos: torch.Tensor  # [m]
    valid: torch.Tensor  # [G, m] bool


def _case(hkv: int, d: int, dtype: torch.dtype, rope: bool, g: int, m: int) -> Case:
    """`g` sequences of `m` candidate centers each, at positions up to ~5,000 (large
    angles), stored in full rows of shuffled slots (a slot's row is not its index);
    every sequence's later centers are invalid (fewer centers before its token), and
    one slot referred to by an invalid entry only is compressed (read_full's clamp)."""
    gen = torch.Generator().manual_seed(hkv * 1000 + d + m)
    spec = DeltaKVSpec(layers=(0,), num_kv_heads=hkv, head_dim=d, latent_dims=(16,))
    compressor = DeltaKVCompressor(spec).to(DEVICE)
    freqs = (1.0 / 10000 ** (torch.arange(0, d, 2) / d)).to(DEVICE) if rope else None
    codec = TokenCodec(CompressorShard(compressor, (0, hkv)), 0, freqs, bits=4)
    num = g * m + 8
    fmt = dataclasses.replace(deltakv_format(codec.code_bytes(), NREF, 10, 0), fixed_rows=num)
    storage = DeltaKVStorage(fmt, num + 5, hkv, d, dtype, DEVICE)
    slots = torch.randperm(storage.num_slots, generator=gen)[:num]
    k = 2 * torch.randn(num, hkv, d, generator=gen)
    storage.store(
        k.to(DEVICE), torch.randn(num, hkv, d, generator=gen).to(DEVICE), slots.to(DEVICE)
    )
    table = slots[: g * m].view(g, m)  # each entry its own slot: a permutation
    counts = torch.randint(1, m + 1, (g,), generator=gen)
    counts[0] = m
    valid = torch.arange(m)[None, :] < counts[:, None]  # [G, m]
    if not bool(valid.all()):
        gi, j = (~valid).nonzero()[0].tolist()
        storage.state[int(table[gi, j])] = -2  # a masked entry's slot that holds no row
    c_pos = torch.sort(torch.randperm(5000, generator=gen)[:m]).values
    xt = 3 * torch.randn(g, 2 * hkv * d, generator=gen)
    return Case(storage, codec, xt.to(DEVICE), table.to(DEVICE), c_pos.to(DEVICE), valid.to(DEVICE))


def _reference(case: Case) -> torch.Tensor:
    """`[G, m]` float64: |x_t - x_c|^2 of the codec's float32 vectors, +inf off `valid`."""
    g, m = case.table.shape
    ck, cv = case.storage.read_full(case.table.reshape(-1))
    xc = case.codec.vectors(ck, cv, case.c_pos.repeat(g)).view(g, m, -1).double().cpu()
    diff = xc - case.xt.double().cpu()[:, None, :]
    return (diff * diff).sum(-1).masked_fill(~case.valid.cpu(), float("inf"))


def _rope(case: Case) -> tuple[torch.Tensor, torch.Tensor] | None:
    freqs = case.codec.freqs
    # Exactly as long as the last center needs: its position reads the last row.
    return None if freqs is None else rope_table(freqs, int(case.c_pos[-1]) + 1)


def _assert_matches(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> float:
    """Equal within TOL of the scale, +inf exactly off `valid`; returns the tolerance."""
    got, valid = got.double().cpu(), valid.cpu()
    assert torch.isinf(got[~valid]).all() and torch.isfinite(got[valid]).all()
    tol = TOL * float(want[valid].abs().max())
    torch.testing.assert_close(got[valid], want[valid], atol=tol, rtol=0)
    return tol


def _assert_same_choice(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """The stable sort's first NREF centers are the reference's wherever its NREF-th and
    (NREF+1)-th distances are further apart than `tol` (nowhere else is it decided)."""
    ordered = torch.sort(want, dim=-1, stable=True)
    decided = (ordered.values[:, NREF] - ordered.values[:, NREF - 1]) > tol
    assert bool(decided.any())
    pick = torch.sort(got.double().cpu(), dim=-1, stable=True).indices[:, :NREF]
    mine = pick.sort(-1).values[decided]
    theirs = ordered.indices[:, :NREF].sort(-1).values[decided]
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "hkv,d,dtype,rope,block_d",
    [
        (2, 32, torch.bfloat16, True, None),
        (2, 32, torch.float32, True, None),
        (1, 64, torch.float32, False, None),  # no RoPE: keys as stored
        (3, 40, torch.bfloat16, True, None),  # a half of 20 channels: a masked chunk
        (2, 64, torch.bfloat16, True, 8),  # halves in 4 chunks, values in 16
    ],
)
@pytest.mark.parametrize("g,m", [(5, 37), (3, 16)])
def test_kernel_matches_the_reference(hkv, d, dtype, rope, block_d, g, m):
    case = _case(hkv, d, dtype, rope, g, m)
    got = center_distances(
        case.xt, case.storage.full_k, case.storage.full_v, case.storage.state, case.table,
        case.c_pos, case.valid, _rope(case), block_m=16, block_d=block_d,
    )  # fmt: skip
    want = _reference(case)
    tol = _assert_matches(got, want, case.valid)
    m_valid = int(case.valid.sum(-1).min())
    if m_valid > NREF:
        _assert_same_choice(got, want, tol)


def test_one_sequence_one_tile_and_empty_batches():
    case = _case(2, 32, torch.bfloat16, True, 1, NREF + 2)
    args = (case.storage.full_k, case.storage.full_v, case.storage.state)
    got = center_distances(case.xt, *args, case.table, case.c_pos, case.valid, _rope(case))
    _assert_matches(got, _reference(case), case.valid)
    none = center_distances(
        case.xt[:0], *args, case.table[:0], case.c_pos, case.valid[:0], _rope(case)
    )
    assert none.shape == (0, NREF + 2)


def test_the_codec_measures_tokens_sharing_their_sequences_centers():
    """`TokenCodec.center_distances` of a batch of several tokens per sequence (a
    decode step's blocks): on CPU each sequence's center vectors built once, on CUDA the
    kernel over each token's row; both equal the reference within TOL and pick its
    references."""
    case = _case(2, 32, torch.bfloat16, True, 3, 29)
    sizes = [2, 1, 3]
    row = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)).to(DEVICE)
    gen = torch.Generator().manual_seed(7)
    xt = (3 * torch.randn(sum(sizes), case.xt.shape[1], generator=gen)).to(DEVICE)
    counts = torch.tensor([29, 20, 29, 5, 17, 29])  # a token's centers: a prefix
    valid = (torch.arange(29)[None, :] < counts[:, None]).to(DEVICE)
    cand = CenterCandidates(
        seq_table=case.table, sizes=sizes, table=case.table[row], valid=valid,
        c_pos=case.c_pos, span=int(case.c_pos[-1]) + 1,
    )  # fmt: skip
    got = case.codec.center_distances(case.storage, xt, cand)
    per_token = dataclasses.replace(case, xt=xt, table=cand.table, valid=valid)
    want = _reference(per_token)
    _assert_same_choice(got, want, _assert_matches(got, want, valid))


def test_bad_layouts_are_refused():
    case = _case(2, 32, torch.float32, False, 2, 8)
    fk, fv, st = case.storage.full_k, case.storage.full_v, case.storage.state
    with pytest.raises(ValueError, match="xt"):
        center_distances(case.xt.half(), fk, fv, st, case.table, case.c_pos, case.valid, None)
    with pytest.raises(ValueError, match="full_k"):
        strided = fk.transpose(1, 2).contiguous().transpose(1, 2)
        center_distances(case.xt, strided, fv, st, case.table, case.c_pos, case.valid, None)
    with pytest.raises(ValueError, match="valid"):
        center_distances(case.xt, fk, fv, st, case.table, case.c_pos, case.valid.int(), None)


def test_rope_tables_are_shared_and_grow():
    case = _case(2, 32, torch.bfloat16, True, 2, 8)
    tables = case.codec.rope_tables
    freqs = case.codec.freqs
    assert freqs is not None
    small = tables.get(freqs, DEVICE, 10)
    assert tables.get(freqs, DEVICE, 1000)[0].data_ptr() == small[0].data_ptr()
    big = tables.get(freqs, DEVICE, 5000)
    assert big[0].shape[0] >= 5000
    assert torch.equal(big[0][: small[0].shape[0]], small[0])
