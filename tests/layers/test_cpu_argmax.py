"""Greedy sampling's native argmax (layers/cpu_argmax.py) against torch's: the first
maximal index, NaNs above every number, infinities, rows of every length, and the
fallbacks; and the sampler's greedy tokens through it."""

from __future__ import annotations

import pytest
import torch
from tests.native_env import needs_c_compiler

from sparsevllm.layers.cpu_argmax import argmax
from sparsevllm.layers.sampler import Sampler
from sparsevllm.sampling import SamplingParams

NAN, INF = float("nan"), float("inf")


@needs_c_compiler
@pytest.mark.parametrize("width", [1, 15, 16, 17, 33, 1000, 49152])
def test_equals_torch_with_ties(width):
    torch.manual_seed(width)
    for logits in (torch.randn(5, width), torch.randint(0, 3, (5, width)).float()):
        assert torch.equal(argmax(logits), logits.argmax(-1))


@needs_c_compiler
def test_nans_and_infinities_as_torch():
    rows = [
        [1.0, 3.0, 3.0, 2.0],
        [NAN, 5.0, NAN, 1.0],
        [-INF, -INF, -INF, -INF],
        [1.0, INF, INF, 0.0],
        [7.0, 1.0, 2.0, NAN],  # the NaN wins though the maximum comes first
    ]
    logits = torch.tensor(rows)
    assert torch.equal(argmax(logits), logits.argmax(-1))
    wide = torch.zeros(2, 100)
    wide[0, 50], wide[1, 99] = NAN, 1.0
    assert argmax(wide).tolist() == [50, 99]


@needs_c_compiler
def test_strided_rows():
    base = torch.randn(4, 300)
    view = base[:, :257]  # row stride 300
    assert torch.equal(argmax(view), view.argmax(-1))


def test_other_inputs_fall_back():
    assert argmax(torch.randn(2, 8).bfloat16()) is None
    assert argmax(torch.randn(8)) is None
    assert argmax(torch.randn(8, 2).T) is None
    assert argmax(torch.zeros(3, 0)) is None


def test_sampler_greedy_tokens_equal_torch_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    out = Sampler()(logits, params, [([], []) for _ in range(6)], [None] * 6)
    assert torch.equal(torch.as_tensor(out.token_ids), logits.argmax(-1))
