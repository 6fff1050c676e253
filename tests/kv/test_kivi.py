"""KIVI storage (kv/kivi.py, kv/kivi_codes.py): codes, the error bound of sealed groups,
the residual window, per-head compaction, tier rows and the accounting of shared state."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsevllm.kv import kivi_codes as codes
from sparsevllm.kv.format import FormatSizing
from sparsevllm.kv.kivi import SHARED_GROUPS, KiviStorage
from sparsevllm.kv.registry import get_format

HKV, D, SLOTS, G = 2, 16, 64, 4
BITS = {"int4": 4, "int2": 2}


def make(name: str, dtype: torch.dtype = torch.float32, group: int = G) -> KiviStorage:
    sizing = FormatSizing(group, 8, max_num_seqs=2, max_step_tokens=48, scratch_rows=0)
    storage = get_format(name).sized(sizing).create(SLOTS, HKV, D, dtype, torch.device("cpu"))
    assert isinstance(storage, KiviStorage)
    return storage


def random_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HKV, D, generator=g)
    x[:, :, 3] *= 20.0  # an outlier channel, as in real keys
    return x


def free_state(storage: KiviStorage) -> tuple[int, int]:
    """Residual rows free, key groups referenced."""
    return storage.num_residual_free, int((storage.group_refs != 0).sum())


@given(st.sampled_from([2, 4]), st.integers(1, 5), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_pack_and_unpack_are_inverse(bits, bytes_per_row, seed):
    g = torch.Generator().manual_seed(seed)
    per_byte = 8 // bits
    c = torch.randint(0, 1 << bits, (3, bytes_per_row * per_byte), generator=g).to(torch.uint8)
    packed = codes.pack(c, bits)
    assert packed.shape == (3, bytes_per_row)
    assert torch.equal(codes.unpack(packed, bits), c)


def step_bound(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Half a quantization step of groups spanning `x` along `dim`, plus the rounding of
    the float16 scale and zero point (which the codes are computed with)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    half_step = (hi - lo) / codes.code_max(bits) / 2
    return half_step * 1.002 + lo.abs() * 2.0**-10 + 1e-6


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("seed", range(3))
def test_sealed_keys_and_values_are_within_half_a_step(name, seed):
    storage, bits = make(name), BITS[name]
    k, v = random_kv(8, seed), random_kv(8, seed + 50)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:8]
    storage.store(k, v, slots)
    assert all(torch.equal(a, b) for a, b in zip(storage.read(slots), (k, v)))  # residual
    storage.seal(slots.view(2, G))
    k_back, v_back = storage.read(slots)
    # keys: per channel over each group of G tokens; values: per token and head
    k_bound = step_bound(k.view(2, G, HKV, D), 1, bits).expand(2, G, HKV, D).reshape(8, HKV, D)
    v_bound = step_bound(v, -1, bits).expand_as(v)
    assert bool(((k_back - k).abs() <= k_bound).all())
    assert bool(((v_back - v).abs() <= v_bound).all())
    assert not torch.equal(k_back, k) and not torch.equal(v_back, v)
    assert free_state(storage) == (storage.kivi.residual_rows, 2)


def test_a_constant_group_and_padding_are_exact():
    storage = make("int4")
    k = torch.full((3, HKV, D), 0.75)
    storage.store(k, k, torch.tensor([5, 6, 7]))
    storage.seal(torch.tensor([[5, 6, 7, -1]]))
    assert torch.equal(storage.read_keys(torch.tensor([5, 6, 7])), k)
    assert int(storage.group_refs.sum()) == 3  # the padding is not counted


def test_sealing_twice_changes_nothing_and_releasing_gives_everything_back():
    storage = make("int2")
    slots = torch.arange(10, 18)
    storage.store(random_kv(8, 1), random_kv(8, 2), slots)
    storage.seal(slots[:4].view(1, G))
    once = storage.read(slots)
    storage.seal(slots.view(2, G))  # the first group is sealed already: left as it is
    assert torch.equal(storage.read(slots[:4])[0], once[0][:4])
    assert free_state(storage)[1] == 2
    storage.release(slots)
    assert free_state(storage) == (storage.kivi.residual_rows, 0)
    assert bool((storage.state[slots] == -1).all())


def test_per_head_compaction_regroups_keys_keeps_values_and_the_residual_tail():
    storage = make("int4")
    slots = torch.arange(12)
    k, v = random_kv(12, 3), random_kv(12, 4)
    storage.store(k, v, slots)
    storage.seal(slots[:8].view(2, G))  # 8 sealed, 4 residual
    # Head h keeps entries src[:, h]; the last two rows are residual in every head.
    src = torch.tensor([[0, 1], [2, 5], [6, 3], [9, 7], [10, 10], [11, 11]])
    before_k, before_v = storage.read_heads(src)
    storage.compact_heads(src, slots[:6])
    storage.release(slots[6:])  # what the pool frees afterwards
    after_k, after_v = storage.read(slots[:6])
    assert torch.equal(after_v[:3], before_v[:3])  # sealed values move with their codes
    assert torch.equal(after_k[4:], before_k[4:]) and torch.equal(after_v[4:], before_v[4:])
    assert storage.residual_tail(slots[:6]) == 2
    # Row 3 had a residual head (slot 9): its keys joined the new group, values quantized.
    bound = step_bound(before_k[:4].unsqueeze(0), 1, 4).squeeze(0)
    assert bool(((after_k[:4] - before_k[:4]).abs() <= bound).all())
    assert bool(((after_v[3, 0] - v[9, 0]).abs() <= step_bound(v[9, 0], -1, 4)).all())
    assert torch.equal(after_v[3, 1], before_v[3, 1])
    assert free_state(storage) == (storage.kivi.residual_rows - 2, 1)  # one new group


def test_tier_rows_carry_their_key_groups_and_restore_bit_exact():
    a, b = make("int4", torch.bfloat16), make("int4", torch.bfloat16)
    slots = torch.arange(8)
    a.store(random_kv(8, 5), random_kv(8, 6), slots)
    a.seal(slots.view(2, G))
    rows = a.gather_rows(torch.tensor([6, 1, 2]))  # two groups referenced
    assert rows[SHARED_GROUPS].shape[0] == 2
    b.scatter_rows(torch.tensor([30, 31, 32]), rows)
    assert all(
        torch.equal(x, y)
        for x, y in zip(b.read(torch.tensor([30, 31, 32])), a.read(torch.tensor([6, 1, 2])))
    )
    assert sorted(b.group_refs[b.group_refs > 0].tolist()) == [1, 2]
    a.store(random_kv(1, 7), random_kv(1, 7), torch.tensor([9]))
    with pytest.raises(RuntimeError, match="leave the pool sealed"):
        a.gather_rows(torch.tensor([9]))


def test_key_groups_are_reclaimed_once_no_slot_references_them():
    storage = make("int4")
    total = storage.group_refs.numel()
    for round_ in range(3 * total // 2):  # more groups than the table holds, over time
        slots = torch.arange(4) + 4 * (round_ % 4)
        storage.store(random_kv(4, round_), random_kv(4, round_), slots)
        storage.seal(slots.view(1, G))
        storage.release(slots)
    assert free_state(storage) == (storage.kivi.residual_rows, 0)


def test_bytes_per_slot_count_codes_parameters_and_amortised_groups():
    dense = get_format("auto").bytes_per_slot(8, 128, torch.bfloat16)
    int4 = get_format("int4").bytes_per_slot(8, 128, torch.bfloat16)
    int2 = get_format("int2").bytes_per_slot(8, 128, torch.bfloat16)
    # int4: 2 x 8 x 64 code bytes + 8 value (scale, zero) pairs x 4 B + state + the key
    # groups' 8 x 128 x 4 B (+ a reference count) per 32 tokens, x 1.25 slack.
    assert int4 == 1024 + 32 + 4 + 161
    assert int2 == 512 + 32 + 4 + 161
    assert dense / int4 > 3.3 and dense / int2 > 5.6
    storage = make("int4", torch.bfloat16)
    assert storage.bytes_per_slot() == get_format("int4").sized(
        FormatSizing(G, 8, 2, 48, 0)
    ).bytes_per_slot(HKV, D, torch.bfloat16)


def test_padded_store_rows_are_not_stored_and_take_no_residual_row():
    """A captured decode batch pads its rows with slot -1: those rows leave every slot,
    the residual rows and the key groups as a store of the real rows alone would."""
    padded, plain = make("int4"), make("int4")
    k, v = random_kv(4, 7), random_kv(4, 8)
    slots = torch.tensor([3, -1, 9, -1])
    padded.store(k, v, slots)
    plain.store(k[[0, 2]], v[[0, 2]], slots[[0, 2]])
    for name, buf in padded.buffers().items():
        assert torch.equal(buf, plain.buffers()[name]), name
    assert free_state(padded) == free_state(plain) == (padded.kivi.residual_rows - 2, 0)
    assert all(
        torch.equal(a, b) for a, b in zip(padded.read(slots[[0, 2]]), (k[[0, 2]], v[[0, 2]]))
    )
    padded.store(k[:2], v[:2], torch.tensor([3, -1]))  # overwriting slot 3 frees its row
    assert free_state(padded) == (padded.kivi.residual_rows - 2, 0)
