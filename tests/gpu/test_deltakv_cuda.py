"""DeltaKV serving is CPU-only for now: on an H200 its greedy tokens left the CPU
engine's (25 of 96 equal at one chunk, INT4 and float16 latents alike), so an engine on
CUDA is refused at construction with an error naming the format and the device."""

from __future__ import annotations

import pytest
import torch

from deltakv_serving import make_checkpoint
from sparsevllm import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def test_deltakv_on_cuda_is_refused(model, tmp_path):
    checkpoint = make_checkpoint(model, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="'deltakv' cannot be used on cuda"):
        LLM(model, device="cuda", sparse_method="deltakv", deltakv_checkpoint=checkpoint)
