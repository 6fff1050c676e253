"""The gated MLP's native SiLU x up (layers/cpu_silu_mul.py) against the torch form it
replaces: bfloat16 bit-equal, float32 to the last bits, strided halves of one GEMM's
output, the edges of SiLU, and the fallbacks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests.native_env import needs_c_compiler

from sparsevllm.layers.cpu_silu_mul import silu_mul
from sparsevllm.layers.mlp import GatedMLP


@needs_c_compiler
def test_bfloat16_equals_torch_bit_for_bit_over_strided_halves():
    torch.manual_seed(0)
    gate_up = (torch.randn(300, 2 * 700) * 4).bfloat16()  # one GEMM's [T, 2I] output
    gate, up = gate_up.split(700, dim=-1)
    got = silu_mul(gate, up)
    assert got is not None and got.is_contiguous() and got.dtype == torch.bfloat16
    assert torch.equal(got, F.silu(gate) * up)


@needs_c_compiler
def test_float32_within_the_last_bits_and_the_edges_as_torch():
    torch.manual_seed(1)
    gate, up = torch.randn(64, 333) * 6, torch.randn(64, 333)
    got = silu_mul(gate, up)
    assert got is not None
    assert torch.allclose(got, F.silu(gate) * up, rtol=2e-6, atol=1e-30)
    edges = torch.tensor([[-200.0, -100.0, -89.0, -88.0, -87.5, -1e-30, 0.0, 1e-30, 90.0]])
    edges = torch.cat([edges, torch.tensor([[float("inf"), float("-inf"), float("nan")]])], 1)
    got, want = silu_mul(edges, torch.ones_like(edges)), F.silu(edges)
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=0.0)
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))


def test_other_inputs_fall_back_to_torch():
    half = torch.randn(4, 8).half()
    assert silu_mul(half, half) is None
    g = torch.randn(4, 8, requires_grad=True)
    assert silu_mul(g, g) is None
    assert silu_mul(torch.randn(2, 3, 8), torch.randn(2, 3, 8)) is None
    cols = torch.randn(8, 4).T  # columns not contiguous
    assert silu_mul(cols, cols) is None


def test_mlp_gives_the_torch_form_in_every_dtype():
    torch.manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mlp = GatedMLP(32, 48, "silu").to(dtype)
        x = torch.randn(5, 32).to(dtype)
        with torch.no_grad():
            want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
            got = mlp(x)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), dtype
