"""Sparse methods on multi-head latent attention (tiny DeepSeek-V3): the KV cache holds
one latent row per token and layer, which methods see as one KV head whose keys are the
rows, scored by the per-query-head attention probabilities of the absorbed form.

Every method that serves the layout gives vanilla's tokens with budgets that cover the
context (chunked prefill, preemption); a budget below the context evicts latent rows;
a method that cannot serve the layout is refused at construction with its reason.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_helpers import MATRIX_PROMPTS, METHOD_KNOBS, covering_budget
from sparsevllm import LLM, SamplingParams
from sparsevllm.kv.layout import MLA_LATENT
from sparsevllm.sparse.base import SparseMethod
from sparsevllm.sparse.registry import (
    method_names,
    method_spec,
    methods_table,
    register_method,
    unregister_method,
)
from sparsevllm.sparse.spec import MethodSpec
from tiny_mla import save_tiny_mla

GREEDY_KW = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
GREEDY = SamplingParams(**GREEDY_KW)
PROMPTS = MATRIX_PROMPTS
SERVED = [m for m in method_names() if MLA_LATENT not in method_spec(m).refused_layouts]
REFUSED = [m for m in method_names() if m not in SERVED]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_mla("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


@pytest.fixture(scope="module")
def vanilla_tokens(model):
    return [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_served_methods_are_the_expected_ones():
    assert REFUSED == ["duoattention", "knorm", "expected_attention", "deltakv"]
    layouts = {row["name"]: row["slot_layouts"] for row in methods_table()}  # `sparsevllm methods`
    assert layouts["knorm"] == ["gqa"] and layouts["snapkv"] == ["gqa", "mla_latent"]


@pytest.mark.parametrize("method", [m for m in SERVED if m != "vanilla"])
def test_budget_above_context_reproduces_vanilla(model, vanilla_tokens, method):
    llm = LLM(model, num_kv_slots=110, chunk_prefill_size=7, **covering_budget(method, 128))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == vanilla_tokens
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_slots_used"] == stats["kv_slots_cached"]


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm"])
def test_small_budget_evicts_latent_rows(model, vanilla_tokens, method):
    """A budget below the context keeps fewer rows per layer and still decodes."""
    knobs = METHOD_KNOBS[method]
    llm = LLM(model, sparse_method=method, **knobs)
    llm.engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.step()
    used = llm.engine.stats()["kv_slots_used_per_layer"]
    assert max(used) < len(PROMPTS[0]), used
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)


@pytest.mark.parametrize("method", REFUSED)
def test_methods_that_cannot_serve_mla_are_refused_with_the_reason(model, method):
    reason = method_spec(method).refused_layouts[MLA_LATENT]
    # DeltaKV's required checkpoint is never read: the layout is refused first.
    knobs = {"deltakv_checkpoint": "never-read.safetensors"} if method == "deltakv" else {}
    with pytest.raises(ValueError, match="mla_latent") as err:
        LLM(model, sparse_method=method, **knobs)
    assert reason in str(err.value) and "methods that can: vanilla" in str(err.value)


class Recorder(SparseMethod):
    """Asks for every query row's probabilities and keeps what a method sees."""

    name = "mla_recorder_test"
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def prefill_score_rows(self, step):
        return step.num_new

    def after_step(self, steps, scores, kv):
        for layer in range(self.num_layers):
            keys = kv.keys(steps[0].seq_id, layer)  # [L, Hkv, D]
            Recorder.seen[layer] = (scores[layer][0].clone(), keys.clone())


RECORDER = MethodSpec(
    name="mla_recorder_test",
    family="dense",
    description="records the scores and keys a method sees (a test-defined method)",
    method=Recorder,
)


def test_methods_see_the_latent_rows_and_the_true_attention_probabilities(model):
    """What a method reads on MLA: its keys are transformers' cached latent (normalised
    c_kv then the roped k_pe, one KV head) and its scores are transformers' attention
    probabilities per query head (summed over the requested queries)."""
    prompt = PROMPTS[1]
    register_method(RECORDER)
    try:
        llm = LLM(model, sparse_method="mla_recorder_test", dtype="float32")
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        unregister_method("mla_recorder_test")
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_attentions=True, use_cache=True)
    assert llm.engine.runner.num_kv_heads == 1
    for layer, (scores, keys) in Recorder.seen.items():
        want = out.attentions[layer][0].sum(dim=1)  # [H, q, T] -> [H, T]
        assert scores.shape == want.shape
        assert torch.allclose(scores, want, atol=1e-5), (scores - want).abs().max()
        cached = out.past_key_values.layers[layer]
        latent = torch.cat([cached.keys[0, 0], cached.values[0, 0]], dim=-1)  # [T, R + P]
        assert torch.allclose(keys[:, 0], latent, atol=1e-5)


def test_per_request_methods_on_mla(model):
    """An engine serving several methods on MLA: each request of a mixed batch gets its
    own method's tokens; serving one that cannot read latent rows is refused at start."""
    knobs = {**METHOD_KNOBS["snapkv"]}
    mixed = LLM(model, sparse_methods=["snapkv", "h2o"], **knobs)
    methods = ["snapkv", "h2o", "snapkv", "h2o"]
    params = [SamplingParams(**GREEDY_KW, sparse_method=m) for m in methods]
    outs = [o.token_ids for o in mixed.generate(PROMPTS, params, use_tqdm=False)]
    for method in ("snapkv", "h2o"):
        alone = LLM(model, sparse_method=method, **knobs)
        idx = [i for i, m in enumerate(methods) if m == method]
        want = alone.generate(
            [PROMPTS[i] for i in idx], SamplingParams(**GREEDY_KW), use_tqdm=False
        )
        assert [outs[i] for i in idx] == [o.token_ids for o in want]
    with pytest.raises(ValueError, match="'knorm' cannot serve this model's mla_latent"):
        LLM(model, sparse_methods=["snapkv", "knorm"])
