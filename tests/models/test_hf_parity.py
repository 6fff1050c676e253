"""Our model implementations against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsevllm import LLM, SamplingParams

KINDS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
PROMPTS = [
    [1, 17, 33, 5, 90, 12],
    [1, 200, 3, 3, 41, 7, 88, 19, 250, 6, 77, 31, 4],
    [1, 9],
    [1] + list(range(30, 60)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def hf_reference(tiny_model_factory):
    return {k: hf_greedy(tiny_model_factory(k), PROMPTS, 32) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(tiny_model_factory, kind):
    path = tiny_model_factory(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    for prompt in PROMPTS:
        ours = llm.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_matches_transformers(tiny_model_factory, hf_reference, kind):
    llm = LLM(tiny_model_factory(kind), dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference[kind]
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.stats()["max_concurrent_seqs"] == len(PROMPTS)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"chunk_prefill_size": 7},
        {"max_num_seqs": 2},
        {"num_kv_slots": 90, "chunk_prefill_size": 16},
    ],
    ids=["chunked", "queued", "preempted"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_scheduling_variants_keep_outputs(tiny_model_factory, hf_reference, kind, engine_kwargs):
    llm = LLM(tiny_model_factory(kind), dtype="float32", **engine_kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference[kind]
    stats = llm.stats()
    if "num_kv_slots" in engine_kwargs:
        assert stats["num_preemptions"] > 0
        assert stats["kv_slots_peak"] <= engine_kwargs["num_kv_slots"]
    if "max_num_seqs" in engine_kwargs:
        assert stats["max_concurrent_seqs"] == 2
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]  # no request holds slots
