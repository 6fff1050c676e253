"""Storage formats (kv/): round-trip error bounds, exact compaction and tier rows, names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsevllm.kv.names import FORMAT_NAMES
from sparsevllm.kv.registry import KV_FORMATS, check_device, get_format

HKV, D, SLOTS = 3, 16, 40
QUANTIZED = ["fp8_e4m3", "int8"]
FLOAT16 = ["bfloat16", "float16"]  # 16-bit floats under any compute dtype
# Formats whose every byte belongs to one slot (KIVI's groups and residual rows are
# shared state: tests/kv/test_kivi.py).
SLOT_LOCAL = ["auto", *FLOAT16, *QUANTIZED]


def random_kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, one all-zero row, and outliers in some channels.
    x = torch.randn(n, HKV, D, generator=g) * torch.logspace(-3, 2, n).view(n, 1, 1)
    x[0] = 0.0
    x[1, :, 3] *= 50.0
    return x.to(dtype)


def make(name: str, dtype: torch.dtype = torch.float32):
    return get_format(name).create(SLOTS, HKV, D, dtype, torch.device("cpu"))


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The largest error a format may make on each element of `x` `[n, Hkv, D]`."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    if name == "int8":
        return amax / 127 / 2  # half a quantization step
    if name == "fp8_e4m3":
        scale = amax / 448
        # 3 mantissa bits: half an ulp is 2^-4 of the value; below the smallest normal
        # (2^-6) the step is 2^-9 of the scale.
        return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    if name == "bfloat16":  # 8 significant bits, float32's exponent range
        return x.abs() * 2.0**-8
    if name == "float16":  # 11 significant bits; below 2^-14 the step is 2^-24
        return torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25))
    return torch.zeros_like(x)


@pytest.mark.parametrize("name", SLOT_LOCAL)
@pytest.mark.parametrize("seed", range(3))
def test_round_trip_error_is_within_the_formats_bound(name, seed):
    storage = make(name)
    k, v = random_kv(24, seed), random_kv(24, seed + 100)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed))[:24]
    storage.store(k, v, slots)
    k_back, v_back = storage.read(slots)
    for x, back in ((k, k_back), (v, v_back)):
        assert back.dtype == torch.float32 and back.shape == x.shape
        err = (back - x).abs()
        assert bool((err <= error_bound(name, x) * (1 + 1e-6) + 1e-30).all())
        assert torch.equal(back[0], torch.zeros_like(back[0]))  # the zero row stays zero
    if name != "auto":
        # Not lossless: the bound is what is tested, not a pass-through.
        assert not torch.equal(k_back, k)


@pytest.mark.parametrize("name", QUANTIZED)
def test_int8_and_fp8_keep_about_half_of_bf16s_bytes(name):
    fmt = get_format(name)
    dense = get_format("auto").bytes_per_slot(8, 128, torch.bfloat16)
    assert fmt.bytes_per_slot(8, 128, torch.bfloat16) == 2 * 8 * (128 + 4)
    assert fmt.bytes_per_slot(8, 128, torch.bfloat16) / dense == pytest.approx(0.516, abs=1e-3)
    assert make(name, torch.bfloat16).bytes_per_slot() == fmt.bytes_per_slot(HKV, D, torch.bfloat16)


@pytest.mark.parametrize("name", FLOAT16)
def test_16_bit_formats_halve_float32s_bytes_and_run_on_the_cpu_only(name):
    fmt = get_format(name)
    assert fmt.bytes_per_slot(8, 128, torch.float32) == 2 * 8 * 128 * 2
    assert make(name).k.dtype == getattr(torch, name)
    assert fmt.usable_on(torch.device("cpu")) and "cuda" not in fmt.devices


def test_slot_minus_one_is_skipped():
    storage = make("int8")
    k = random_kv(3, 1)
    storage.store(k, k, torch.tensor([5, -1, 6]))
    assert not bool(storage.k[SLOTS - 1].any())  # -1 did not wrap to the last slot
    torch.testing.assert_close(storage.read_keys(torch.tensor([5, 6])), k[[0, 2]], atol=1, rtol=0.1)


@pytest.mark.parametrize("name", SLOT_LOCAL)
def test_per_head_compaction_moves_stored_bytes_exactly(name):
    storage = make(name)
    slots = torch.arange(20)
    storage.store(random_kv(20, 3), random_kv(20, 4), slots)
    before = {n: b.clone() for n, b in storage.buffers().items()}
    values_before = storage.read(slots)
    # Head h keeps view entries src[:, h]; the compacted rows land in slots 0..5.
    src = torch.stack([torch.tensor([1, 4, 7, 9, 12, 19]) + h for h in range(HKV)], 1) % 20
    dst = torch.arange(6)
    storage.compact_heads(src, dst)
    for name_, buf in storage.buffers().items():
        for h in range(HKV):
            assert torch.equal(buf[dst, h], before[name_][src[:, h], h])
    k_after, v_after = storage.read(dst)
    for h in range(HKV):
        assert torch.equal(k_after[:, h], values_before[0][src[:, h], h])
        assert torch.equal(v_after[:, h], values_before[1][src[:, h], h])


@pytest.mark.parametrize("name", SLOT_LOCAL)
def test_tier_rows_round_trip_bit_exact_in_the_stored_form(name):
    a, b = make(name, torch.bfloat16), make(name, torch.bfloat16)
    a.store(random_kv(10, 5), random_kv(10, 6), torch.arange(10))
    rows = a.gather_rows(torch.tensor([3, 1, 8]))
    assert set(rows) == set(a.buffers())
    b.scatter_rows(torch.tensor([30, 31, 32]), rows)
    for n in a.buffers():
        assert torch.equal(b.buffers()[n][30:33], a.buffers()[n][[3, 1, 8]])
    moved = sum(t.numel() * t.element_size() for t in rows.values())
    assert moved == 3 * a.bytes_per_slot()
    other = make("auto" if get_format(name).scaled else "int8", torch.bfloat16)
    with pytest.raises(ValueError, match="storage has"):
        other.scatter_rows(torch.tensor([0, 1, 2]), rows)


def test_unknown_name_names_the_closest_format():
    with pytest.raises(ValueError, match="did you mean 'int8'"):
        get_format("int9")
    assert tuple(KV_FORMATS) == FORMAT_NAMES


def test_a_device_that_cannot_read_a_format_is_refused_with_the_usable_ones():
    gpu_only = dataclasses.replace(get_format("int8"), name="gpu_only", devices=("cuda",))
    with pytest.raises(
        ValueError, match="cannot be used on cpu; usable here: auto, bfloat16, float16, fp8_e4m3"
    ):
        check_device(gpu_only, torch.device("cpu"))
