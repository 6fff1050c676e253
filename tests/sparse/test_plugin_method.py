"""A method is one file: this module defines a whole method (knobs, spec, a score) and
runs it through `LLM`, `sparsevllm generate` flags and a JSON config, editing nothing
else in the project."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass

import pytest
import torch

from sparsevllm import LLM, SamplingParams
from sparsevllm.cli import main
from sparsevllm.sparse.registry import method_names, register_method, unregister_method
from sparsevllm.sparse.score_eviction import ScoreEviction
from sparsevllm.sparse.spec import SHARED_BUDGET, MethodKnobs, MethodSpec, knob


@dataclass(frozen=True)
class StrideKnobs(MethodKnobs):
    stride_every: int = knob(3, "Keep every n-th token of the middle (newest first).", minimum=1)


class Stride(ScoreEviction):
    """Keeps sink + recent + the newest tokens whose position is a multiple of
    `stride_every`, per KV head (the same for every head)."""

    name = "stride_test"
    knobs: StrideKnobs

    def score(self, layer, step, kv, attn):
        length = kv.resident(step.seq_id, layer)
        return stride_scores(length, self.knobs.stride_every).expand(self.num_kv_heads, -1)


def stride_scores(length: int, every: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.float32)
    return (pos % every == 0).float() + pos * 1e-6  # aligned first, newest among equals


SPEC = MethodSpec(
    name="stride_test",
    family="physical_eviction",
    description="sink + recent + every n-th older token (a test-defined method)",
    method=Stride,
    knobs=StrideKnobs,
    budget_fields=SHARED_BUDGET,
    budget_knob="decode_keep_tokens",
    chain_cache=True,
)
PROMPTS = [[1, *range(10, 70)], [1, *range(100, 125)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = {"decode_keep_tokens": 24, "sink_keep_tokens": 4, "recent_keep_tokens": 8}


@pytest.fixture
def registered():
    register_method(SPEC, aliases=("every-nth-test",))
    yield
    unregister_method(SPEC.name)
    assert SPEC.name not in method_names()


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


def test_llm_runs_the_method_and_frees_its_slots(registered, model):
    llm = LLM(model, sparse_method="every-nth-test", stride_every=5, **SMALL)
    assert llm.engine.method.knobs == StrideKnobs(stride_every=5)
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # the whole 61-token prompt in one step, then eviction
    assert engine.stats()["kv_slots_used_per_layer"] == [24] * 4
    while engine.has_unfinished_requests():
        engine.step()


def test_budget_above_context_gives_vanilla_tokens(registered, model):
    vanilla = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(model, sparse_method="stride_test", decode_keep_tokens=4096, recent_keep_tokens=64)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == vanilla


def test_cli_flags_reach_the_method(registered, model):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["generate", "--model", model, "--prompt", "w1 w2 w3", "--max-tokens", "4"]
            + ["--sparse-method", "stride_test", "--stride-every", "7", "--json", "--no-progress"]
        )
    assert code == 0
    report = json.loads(out.getvalue())
    assert report["config"]["sparse_method"] == "stride_test"
    assert report["config"]["stride_every"] == 7
    assert len(report["outputs"][0]["token_ids"]) == 4


def test_json_config_and_its_errors(registered, model, tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"model": model, "sparse_method": "stride_test", "stride_every": 2}))
    llm = LLM.from_config(path)
    assert llm.engine.method.knobs.stride_every == 2
    assert llm.engine.method.knob_values()["stride_every"] == 2
    path.write_text(json.dumps({"model": model, "sparse_method": "stride_test", "stride_evry": 2}))
    with pytest.raises(ValueError, match="did you mean 'stride_every'"):
        LLM.from_config(path)
    with pytest.raises(ValueError, match="stride_every must be >= 1"):
        LLM(model, sparse_method="stride_test", stride_every=0)
    with pytest.raises(ValueError, match="stride_every is a knob of stride_test"):
        LLM(model, sparse_method="snapkv", stride_every=2)


def test_the_score_keeps_aligned_tokens_newest_first():
    top = stride_scores(20, 3)[4:12].topk(2).indices + 4  # the middle of a 20-token view
    assert sorted(top.tolist()) == [6, 9]
