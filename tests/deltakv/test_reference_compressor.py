"""DeltaKV's compression and reconstruction against a plain float64 reference of the
definition (docs/methods.md, "DeltaKV"): loops over tokens, no batching, no sort tricks."""

from __future__ import annotations

import math

import pytest
import torch

from sparsevllm.deltakv.centers import (
    center_positions,
    compressed_positions,
    is_center,
    select_references,
)
from sparsevllm.deltakv.compressor import DeltaKVCompressor, join_kv, split_kv
from sparsevllm.deltakv.latent_codes import pack_latents, quantize_latents, unpack_latents
from sparsevllm.deltakv.rope import rotate, unrotate
from sparsevllm.deltakv.spec import DeltaKVSpec, stride_of_ratio


def ref_is_center(p: int, sink: int, stride: int) -> bool:
    return p < sink or (p - sink) % stride == 0


def ref_references(x: list[list[float]], t: int, sink: int, stride: int, k: int) -> list[int]:
    """The k nearest (squared L2) centers before t, ties to the earlier one."""
    cands = [c for c in range(t) if ref_is_center(c, sink, stride)]
    dist = [(sum((a - b) ** 2 for a, b in zip(x[t], x[c])), c) for c in cands]
    return [c for _, c in sorted(dist)[:k]]


def ref_map(w: list[list[float]], b: list[float], v: list[float]) -> list[float]:
    return [sum(wi * vi for wi, vi in zip(row, v)) + bi for row, bi in zip(w, b)]


def ref_mlp(layers: dict[str, torch.Tensor], v: list[float]) -> list[float]:
    h = ref_map(layers["fc_in.weight"].tolist(), layers["fc_in.bias"].tolist(), v)
    h = [0.5 * a * (1 + math.erf(a / math.sqrt(2))) for a in h]  # exact GELU
    return ref_map(layers["fc_out.weight"].tolist(), layers["fc_out.bias"].tolist(), h)


def ref_apply(state: dict[str, torch.Tensor], prefix: str, v: list[float]) -> list[float]:
    own = {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}
    if "weight" in own:
        return ref_map(own["weight"].tolist(), own["bias"].tolist(), v)
    return ref_mlp(own, v)


def ref_round_trip(state, layer, x, t, refs):
    """latent = down(x_t) - down(mean refs); x_hat = up(latent) + mean refs."""
    base = [sum(x[c][j] for c in refs) / len(refs) for j in range(len(x[t]))]
    down = f"layers.{layer}.down_proj."
    latent = [a - b for a, b in zip(ref_apply(state, down, x[t]), ref_apply(state, down, base))]
    up = ref_apply(state, f"layers.{layer}.up_proj.", latent)
    return latent, [a + b for a, b in zip(up, base)]


def test_center_rule_matches_the_reference():
    for sink, stride in ((0, 1), (4, 10), (3, 7), (1, 3)):
        pos = torch.arange(60)
        mask = is_center(pos, sink, stride).tolist()
        assert mask == [ref_is_center(p, sink, stride) for p in range(60)]
        assert center_positions(60, sink, stride).tolist() == [p for p in range(60) if mask[p]]
        assert compressed_positions(60, sink, stride).tolist() == [
            p for p in range(60) if not mask[p]
        ]


@pytest.mark.parametrize("sink,stride,k", [(4, 10, 4), (2, 5, 3), (1, 4, 1), (4, 3, 2)])
def test_references_match_the_reference(sink, stride, k):
    torch.manual_seed(sink * 10 + stride)
    x = torch.randn(90, 12, dtype=torch.float64)
    got = select_references(x, sink, stride, k, chunk=17)  # chunk boundaries inside
    rows = x.tolist()
    want = [
        ref_references(rows, t, sink, stride, k) for t in compressed_positions(90, sink, stride)
    ]
    assert got.tolist() == want


def test_ties_go_to_the_earlier_center():
    x = torch.zeros(30, 4, dtype=torch.float64)  # every distance is 0
    refs = select_references(x, 4, 5, 3)
    assert refs.tolist() == [[0, 1, 2]] * refs.shape[0]


def test_float32_references_agree_with_float64():
    torch.manual_seed(3)
    x = torch.randn(400, 48, dtype=torch.float64) * 4 + 2
    a = select_references(x, 4, 10, 4)
    b = select_references(x.float(), 4, 10, 4)
    assert (a == b).float().mean() > 0.99


@pytest.mark.parametrize("hidden", [0, 8])
def test_compress_and_reconstruct_match_the_reference(hidden):
    torch.manual_seed(hidden)
    spec = DeltaKVSpec(
        layers=(1, 3), num_kv_heads=2, head_dim=4, latent_dims=(5, 3), hidden_dim=hidden
    )
    model = DeltaKVCompressor(spec).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(40, spec.kv_dim, dtype=torch.float64)
    comp = compressed_positions(40, spec.sink_tokens, spec.center_stride)
    refs = select_references(x, spec.sink_tokens, spec.center_stride, spec.num_references)
    state = {k: v for k, v in model.state_dict().items()}
    rows = x.tolist()
    for layer in spec.layers:
        latent = model.compress(layer, x[comp], x[refs])
        out = model.reconstruct(layer, latent, x[refs])
        for i, t in enumerate(comp.tolist()):
            want_latent, want_out = ref_round_trip(state, layer, rows, t, refs[i].tolist())
            assert torch.allclose(latent[i], torch.tensor(want_latent, dtype=torch.float64))
            assert torch.allclose(out[i], torch.tensor(want_out, dtype=torch.float64))


def test_zero_latent_reconstructs_the_up_bias_plus_the_reference_mean():
    spec = DeltaKVSpec(layers=(0,), num_kv_heads=1, head_dim=4, latent_dims=(2,))
    model = DeltaKVCompressor(spec).double()
    centers = torch.randn(3, 4, 8, dtype=torch.float64)
    out = model.reconstruct(0, torch.zeros(3, 2, dtype=torch.float64), centers)
    bias = model.codec(0).up_proj.bias
    assert torch.allclose(out, centers.mean(1) + bias)


def test_join_and_split_kv_put_every_head_of_k_before_v():
    k = torch.arange(2 * 3 * 4).float().view(2, 3, 4)
    v = -k
    x = join_kv(k, v)
    assert x.shape == (2, 24)
    assert x[1, :12].tolist() == k[1].flatten().tolist()
    k2, v2 = split_kv(x, 3, 4)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def ref_int4(row: list[float]) -> list[float]:
    """Asymmetric 4-bit codes of one group: float16 scale (span / 15) and zero (min)."""
    lo, hi = min(row), max(row)
    scale = float(torch.tensor((hi - lo) / 15).half()) or 1.0
    zero = float(torch.tensor(lo).half())
    codes = [min(15, max(0, round((v - zero) / scale))) for v in row]
    return [c * scale + zero for c in codes]


@pytest.mark.parametrize("group", [0, 4, 8])
def test_int4_latents_match_the_reference(group):
    torch.manual_seed(group)
    latent = torch.randn(7, 16) * 3
    packed = pack_latents(latent, group)
    assert packed.codes.dtype == torch.uint8 and packed.codes.shape == (7, 8)
    assert packed.params.shape == (7, 16 // (group or 16), 2)
    got = unpack_latents(packed)
    size = group or 16
    for i, row in enumerate(latent.tolist()):
        want = [v for g in range(0, 16, size) for v in ref_int4(row[g : g + size])]
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-5)
    assert torch.equal(quantize_latents(latent, group), got)


def test_int4_rejects_odd_groups():
    with pytest.raises(ValueError, match="even group size"):
        pack_latents(torch.zeros(2, 6), 3)


def test_unrotate_inverts_rotate():
    torch.manual_seed(0)
    x = torch.randn(11, 3, 8)
    pos = torch.arange(100, 111)
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.allclose(unrotate(rotate(x, pos, freqs), pos, freqs), x, atol=1e-5)
    assert torch.equal(rotate(x, pos, None), x)


def test_spec_checks_its_fields():
    with pytest.raises(ValueError, match="at most sink_tokens"):
        DeltaKVSpec(layers=(0,), num_kv_heads=1, head_dim=4, latent_dims=(2,), sink_tokens=2)
    with pytest.raises(ValueError, match="ascending"):
        DeltaKVSpec(layers=(2, 1), num_kv_heads=1, head_dim=4, latent_dims=(2, 2))
    with pytest.raises(ValueError, match="latent dims"):
        DeltaKVSpec(layers=(0,), num_kv_heads=1, head_dim=4, latent_dims=(9,))
    assert stride_of_ratio(0.1) == 10 and stride_of_ratio(0.25) == 4
    with pytest.raises(ValueError, match="whole number"):
        stride_of_ratio(0.3)
    spec = DeltaKVSpec(layers=(0, 2), num_kv_heads=2, head_dim=4, latent_dims=(2, 3))
    assert DeltaKVSpec.from_json(spec.to_json()) == spec
