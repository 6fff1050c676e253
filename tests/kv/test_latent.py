"""MLA latent-row storage (kv/latent.py) in every format: one buffer per layer, the value
a view of each row's prefix, exact moves, one row's bytes per token; and the layout's
checks."""

from __future__ import annotations

import pytest
import torch

from sparsevllm.kv.layout import SlotLayout, gqa_layout, latent_layout
from sparsevllm.kv.registry import KV_FORMATS, create_storage, get_format, layer_bytes

RANK, ROPE, SLOTS = 24, 8, 30
LAYOUT = latent_layout(RANK, ROPE)
LATENT_FORMATS = [name for name, fmt in KV_FORMATS.items() if fmt.stores_shared_kv]


def make(name: str, dtype: torch.dtype = torch.float32):
    return create_storage(get_format(name), SLOTS, LAYOUT, dtype, torch.device("cpu"))


def rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, RANK + ROPE, generator=g) * torch.logspace(-2, 1, n).view(n, 1, 1)


@pytest.mark.parametrize("name", LATENT_FORMATS)
def test_keys_are_the_rows_and_values_their_prefix(name):
    storage = make(name)
    x, slots = rows(12, 0), torch.randperm(SLOTS)[:12]
    storage.store(x, x[..., :RANK], slots)
    keys, values = storage.read(slots)
    assert keys.shape == (12, 1, RANK + ROPE) and values.shape == (12, 1, RANK)
    assert torch.equal(values, keys[..., :RANK])  # the same stored bytes, the same scale
    tol = 0.0 if name == "auto" else 0.07 * float(x.abs().max())
    assert float((keys - x).abs().max()) <= tol
    if name != "auto":
        # one scale per row: the error is relative to the row's absmax
        err = (keys - x).abs().amax(dim=-1) / x.abs().amax(dim=-1)
        assert float(err.max()) < 0.07


@pytest.mark.parametrize("name", LATENT_FORMATS)
def test_one_buffer_moves_each_token_once(name):
    storage = make(name, torch.bfloat16)
    storage.store(rows(10, 1), rows(10, 1)[..., :RANK], torch.arange(10))
    buffers = storage.buffers()
    fmt = get_format(name)
    assert set(buffers) == ({"kv", "kv_scale"} if fmt.scaled else {"kv"})
    # bytes: one row (+ one float32 scale), not K and V
    elem = (fmt.element_dtype or torch.bfloat16).itemsize
    expected = (RANK + ROPE) * elem + (4 if fmt.scaled else 0)
    assert storage.bytes_per_slot() == expected
    assert layer_bytes(get_format(name), LAYOUT, torch.bfloat16) == expected
    before = storage.read(torch.tensor([7, 2]))
    storage.compact_heads(torch.tensor([[7], [2]]), torch.tensor([0, 1]))
    after = storage.read(torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    other = make(name, torch.bfloat16)
    other.scatter_rows(torch.tensor([20, 21]), storage.gather_rows(torch.tensor([0, 1])))
    assert all(torch.equal(a, b) for a, b in zip(other.read(torch.tensor([20, 21])), before))


def test_latent_rows_take_a_fraction_of_gqa_bytes():
    # DeepSeek-V3: 576 values per token and layer against 128 heads x 2 x (128 + 64) of
    # its expanded K/V; against a GQA model with 8 KV heads of 128 that is 1152 vs 4096.
    fmt = get_format("auto")
    assert layer_bytes(fmt, latent_layout(512, 64), torch.bfloat16) == 1152
    assert layer_bytes(fmt, gqa_layout(8, 128), torch.bfloat16) == 4096


def test_slot_minus_one_is_skipped():
    storage = make("auto")
    x = rows(3, 2)
    storage.store(x, x[..., :RANK], torch.tensor([4, -1, 5]))
    assert not bool(storage.k[SLOTS - 1].any())
    assert torch.equal(storage.read_keys(torch.tensor([4, 5])), x[[0, 2]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="paged", num_kv_heads=1, head_dim=8, value_dim=8), "unknown slot layout"),
        (dict(name="gqa", num_kv_heads=0, head_dim=8, value_dim=8), "positive sizes"),
        (
            dict(name="mla_latent", num_kv_heads=1, head_dim=8, value_dim=9, shared_kv=True),
            "prefix",
        ),
        (dict(name="gqa", num_kv_heads=2, head_dim=8, value_dim=4), "one head_dim"),
    ],
)
def test_bad_layouts_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SlotLayout(**kwargs)


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_a_format_that_cannot_store_latent_rows_names_the_ones_that_can(name):
    with pytest.raises(
        ValueError, match="cannot store the mla_latent slot layout.*auto, bfloat16, float16, fp8"
    ):
        make(name)
