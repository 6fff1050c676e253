"""DeltaKV's reconstruct-in-decode kernel against the torch path
(`TokenCodec.decode_reference`, sparse/deltakv_codec.py): the same codes, references and
positions give the same K and V."""

from __future__ import annotations

import pytest
import torch

from kernel_env import DEVICE, require_triton

require_triton()

from sparsevllm.attention.triton.deltakv import reconstruct  # noqa: E402
from sparsevllm.deltakv.compressor import DeltaKVCompressor  # noqa: E402
from sparsevllm.deltakv.shard import CompressorShard  # noqa: E402
from sparsevllm.deltakv.spec import DeltaKVSpec  # noqa: E402
from sparsevllm.sparse.deltakv_codec import TokenCodec  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 16, 16), (3, 64, 96), (1, 32, 10)])  # Hkv, D, r
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("bits", [4, 16])
def test_kernel_matches_the_torch_decode(dtype, shape, rope, bits):
    hkv, d, r = shape
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    spec = DeltaKVSpec(layers=(0,), num_kv_heads=hkv, head_dim=d, latent_dims=(r,))
    compressor = DeltaKVCompressor(spec).to(DEVICE)
    freqs = (1.0 / 10000 ** (torch.arange(0, d, 2) / d)).to(DEVICE) if rope else None
    codec = TokenCodec(CompressorShard(compressor, (0, hkv)), 0, freqs, bits=bits)
    n, rows, refs_per = 9, 50, 4
    full_k = torch.randn(rows, hkv, d, generator=g).to(DEVICE, dtype)
    full_v = torch.randn(rows, hkv, d, generator=g).to(DEVICE, dtype)
    row_pos = torch.randint(0, 4000, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    refs = torch.randint(0, rows, (n, refs_per), generator=g).to(DEVICE)
    pos = torch.randint(0, 4000, (n,), generator=g).to(DEVICE)
    codes = codec.encode(torch.randn(n, r, generator=g).to(DEVICE))  # [n, r / 2 + 4]
    ref_k, ref_v, ref_pos = full_k[refs], full_v[refs], row_pos[refs].long()
    want_k, want_v = codec.decode_reference(codes, ref_k, ref_v, ref_pos, pos)
    up = compressor.codec(0).up_proj
    y = up(codec.latents(codes))
    got_k, got_v = reconstruct(y, full_k, full_v, refs, row_pos, pos, freqs)
    torch.testing.assert_close(got_k, want_k, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_v, want_v, atol=2e-5, rtol=1e-5)


def _codec_inputs(dtype: torch.dtype, hkv: int = 2, d: int = 64, r: int = 32):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    spec = DeltaKVSpec(layers=(0,), num_kv_heads=hkv, head_dim=d, latent_dims=(r,))
    compressor = DeltaKVCompressor(spec).to(DEVICE)
    freqs = (1.0 / 10000 ** (torch.arange(0, d, 2) / d)).to(DEVICE)
    codec = TokenCodec(CompressorShard(compressor, (0, hkv)), 0, freqs, bits=4)
    n, rows = 33, 40
    full_k = torch.randn(rows, hkv, d, generator=g).to(DEVICE, dtype)
    full_v = torch.randn(rows, hkv, d, generator=g).to(DEVICE, dtype)
    row_pos = torch.randint(0, 4000, (rows,), generator=g, dtype=torch.int32).to(DEVICE)
    refs = torch.randint(0, rows, (n, 4), generator=g).to(DEVICE)
    pos = torch.randint(0, 4000, (n,), generator=g).to(DEVICE)
    codes = codec.encode(torch.randn(n, r, generator=g).to(DEVICE))
    return codec, codes, full_k, full_v, refs, row_pos, pos


def test_a_16bit_up_projection_is_read_as_its_float32_values():
    codec, codes, full_k, full_v, refs, row_pos, pos = _codec_inputs(torch.bfloat16)
    y = codec.shard.compressor.codec(0).up_proj(codec.latents(codes)).to(torch.bfloat16)
    got = reconstruct(y, full_k, full_v, refs, row_pos, pos, codec.freqs)
    want = reconstruct(y.float(), full_k, full_v, refs, row_pos, pos, codec.freqs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GEMM + kernel path runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_in_the_pool_dtype_stays_within_its_rounding(dtype):
    """A 16-bit pool runs the up map in its dtype; what it stores (K/V in that dtype)
    stays within a few of its roundings of the float32 definition."""
    codec, codes, full_k, full_v, refs, row_pos, pos = _codec_inputs(dtype)
    k, v = codec.decode(codes, full_k, full_v, refs, row_pos, pos)
    ref_k, ref_v, ref_pos = full_k[refs], full_v[refs], row_pos[refs].long()
    want_k, want_v = codec.decode_reference(codes, ref_k, ref_v, ref_pos, pos)
    if dtype == torch.float32:
        torch.testing.assert_close(k, want_k, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, want_v, atol=2e-5, rtol=1e-5)
        return
    eps = torch.finfo(dtype).eps
    for got, want in ((k, want_k), (v, want_v)):
        err = (got.to(dtype).float() - want).abs()
        assert bool((err <= 4 * eps * (want.abs() + 1)).all()), float(err.max())
