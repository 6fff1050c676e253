"""`python -m sparsevllm.bench.profile_step` end to end on a tiny model (CPU stands in for
the GPU: the tool's CUDA checks are patched; its kernel table is then empty)."""

from __future__ import annotations

import json

import pytest
import torch

import sparsevllm.bench.model_configs as model_configs
import sparsevllm.bench.profile_step as profile_step
from conftest import TINY


@pytest.fixture
def as_if_cuda(monkeypatch):
    tiny = dict(model_configs.MODEL_CONFIGS["llama3-8b"])
    shapes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    tiny.update({k: TINY[k] for k in (*shapes, "num_key_value_heads", "vocab_size")})
    monkeypatch.setitem(model_configs.MODEL_CONFIGS, "llama3-8b", tiny)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    asked = []  # only the tool's own check sees a GPU; the engine stays on CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: not asked and not asked.append(1))


def test_profile_step_reports_phases(as_if_cuda, tmp_path, capsys):
    out = tmp_path / "prof.json"
    argv = ["--prompt-len", "40", "--batch-size", "3", "--steps", "2", "--json", str(out)]
    argv += ["--prefill-steps", "1", "--cprofile", "2"]
    profile_step.main([*argv, "--sparse-method", "quest", "--decode-keep-tokens", "36"])
    report = json.loads(out.read_text())
    assert report["args"]["batch_size"] == 3 and report["step_ms"] > 0
    phases = report["host_phases_ms"]
    want = {"schedule", "prepare", "graph_replay", "after_step", "sample_launch", "wait_tokens"}
    want |= {"schedule_ahead", "complete", "outputs", "plan"}
    assert set(phases) == want | {"other"}
    assert phases["schedule"] > 0 and phases["prepare"] > 0 and phases["wait_tokens"] > 0
    assert phases["complete"] > 0 and phases["schedule_ahead"] == 0  # not overlapped
    # cProfile's view of the same steps: the engine's step is among the costliest.
    functions = {r["function"].split(":")[0]: r for r in report["host_functions"]}
    prepare, step = functions["_prepare (runner.py"], functions["step (engine.py"]
    assert prepare["calls_per_step"] == 1
    assert step["cumulative_ms_per_step"] >= prepare["cumulative_ms_per_step"] > 0
    # The wrappers are gone: the engine still steps.
    assert profile_step.SampledTokens.result.__name__ == "result"
    assert report["prefill"]["steps"] == 1 and report["prefill"]["host_phases_ms"]["prepare"] > 0
    assert "host phases, ms per step" in capsys.readouterr().out


def test_profile_step_refuses_a_batch_that_does_not_fit(as_if_cuda, monkeypatch):
    monkeypatch.setattr(profile_step, "MAX_TOKENS", 2)  # the first sequences finish early
    with pytest.raises(SystemExit, match="decode together"):
        profile_step.main(["--prompt-len", "40", "--batch-size", "3", "--steps", "2"])


def test_profile_step_refuses_a_max_model_len_below_the_requests(as_if_cuda):
    with pytest.raises(SystemExit, match="--max-model-len must be at least"):
        profile_step.main(["--prompt-len", "40", "--batch-size", "2", "--max-model-len", "64"])
