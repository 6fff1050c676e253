"""DeepSeek-V3 and GLM-4.7-Flash (multi-head latent attention + shared-experts MoE)
against transformers on tiny random checkpoints: prefill logits, greedy tokens, and the
same tokens with chunked prefill, a queue and preemption over the latent KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsevllm import LLM, SamplingParams
from sparsevllm.attention.latent_expansion import LatentExpansion
from tiny_mla import MLA_KINDS, save_tiny_mla

PROMPTS = [
    [1, 17, 33, 5, 90, 12],
    [1, 200, 3, 3, 41, 7, 88, 19, 250, 6, 77, 31, 4],
    [1, 9],
    [1] + list(range(30, 60)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    paths = {
        k: save_tiny_mla(k, tmp_path_factory.mktemp(k), seed=i) for i, k in enumerate(MLA_KINDS)
    }
    return paths.__getitem__


@pytest.fixture(scope="module")
def hf_reference(mla_model):
    out = {}
    for kind in MLA_KINDS:
        model = AutoModelForCausalLM.from_pretrained(mla_model(kind), dtype=torch.float32).eval()
        out[kind] = [
            model.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]  # fmt: skip
    return out


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_prefill_logits_match_transformers(mla_model, kind):
    hf = AutoModelForCausalLM.from_pretrained(mla_model(kind), dtype=torch.float32).eval()
    llm = LLM(mla_model(kind), dtype="float32")
    for prompt in PROMPTS:
        ours = llm.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


@pytest.mark.parametrize("kind", MLA_KINDS)
def test_greedy_batch_matches_transformers(mla_model, hf_reference, kind):
    llm = LLM(mla_model(kind), dtype="float32")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference[kind]
    assert llm.stats()["max_concurrent_seqs"] == len(PROMPTS)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"chunk_prefill_size": 5},
        {"max_num_seqs": 2},
        {"num_kv_slots": 90, "chunk_prefill_size": 16},
    ],
    ids=["chunked", "queued", "preempted"],
)
@pytest.mark.parametrize("kind", MLA_KINDS)
def test_scheduling_variants_keep_outputs(mla_model, hf_reference, kind, engine_kwargs):
    llm = LLM(mla_model(kind), dtype="float32", **engine_kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference[kind]
    stats = llm.stats()
    if "num_kv_slots" in engine_kwargs:
        assert stats["num_preemptions"] > 0
        assert stats["kv_slots_peak"] <= engine_kwargs["num_kv_slots"]
    assert stats["kv_slots_used"] == stats["kv_slots_cached"]  # no request holds slots


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_quantized_latent_rows(mla_model, hf_reference, fmt):
    """A scaled format stores each latent row with one scale: 4 layers x (40 + 4) bytes
    per token. A prompt prefilled in one chunk reads its own rows as computed, so its
    logits are exact; decode steps read the stored rows (int8 keeps the first 8 greedy
    tokens of every prompt here; fp8's 3 mantissa bits drift sooner)."""
    path = mla_model("deepseek_v3")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", kv_cache_dtype=fmt)
    assert llm.stats()["kv_bytes_per_slot"] == 4 * (32 + 8 + 4)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[3]])).logits[0]
    assert torch.allclose(llm.prompt_logits(PROMPTS[3]), ref, atol=1e-4, rtol=0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 32 for o in outs)
    if fmt == "int8":
        assert [o.token_ids[:8] for o in outs] == [r[:8] for r in hf_reference["deepseek_v3"]]


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"chunk_prefill_size": 5}, {"sparse_method": "snapkv", "decode_keep_tokens": 4096}],
    ids=["one-chunk", "chunked", "snapkv-covering"],
)
@pytest.mark.parametrize("kind", MLA_KINDS)
def test_expanded_prefill_keeps_outputs(mla_model, hf_reference, kind, engine_kwargs, monkeypatch):
    """Prefill chunks attended in the expanded form (per-head K/V up-projected from the
    latent rows; here every chunk of 2+ queries) give transformers' logits and tokens."""
    calls = []
    attend = LatentExpansion.attend

    def counted(self, start, n, rows, scale):
        calls.append(n)
        return attend(self, start, n, rows, scale)

    monkeypatch.setattr(LatentExpansion, "worth", lambda self, n, length: n > 1)
    monkeypatch.setattr(LatentExpansion, "attend", counted)
    hf = AutoModelForCausalLM.from_pretrained(mla_model(kind), dtype=torch.float32).eval()
    llm = LLM(mla_model(kind), dtype="float32", **engine_kwargs)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[3]])).logits[0]
    assert torch.allclose(llm.prompt_logits(PROMPTS[3]), ref, atol=1e-4, rtol=0)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_reference[kind]
    assert calls and max(calls) > 1
