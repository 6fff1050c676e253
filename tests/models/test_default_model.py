"""The bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from sparsevllm import LLM, SamplingParams
from sparsevllm.models.default_model import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF path: its config and its own dequantized weights."""
    path = default_model_path()
    dirname, basename = os.path.split(path)
    cfg = transformers.AutoConfig.from_pretrained(dirname, gguf_file=basename)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta)["tensors"]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def test_default_model_greedy_equals_transformers(hf_model):
    llm = LLM(dtype="float32")  # no model argument: the bundled default
    prompt = llm.apply_chat_template(QUESTION)
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    assert ours.token_ids == ref
    assert "Paris" in ours.text
