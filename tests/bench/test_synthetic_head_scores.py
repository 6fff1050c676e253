"""Synthetic DuoAttention head scores for dummy-weight throughput benchmarks."""

from __future__ import annotations

import pytest

from sparsevllm.bench.model_configs import write_model_config
from sparsevllm.bench.synthetic_head_scores import main
from sparsevllm.calibration.head_scores import read_head_scores
from sparsevllm.calibration.identity import model_identity
from sparsevllm.models.loader import load_model_source


def test_scores_fit_the_dummy_model_and_repeat_by_seed(tmp_path):
    paths = [tmp_path / f"{i}.json" for i in range(3)]
    for path, seed in zip(paths, (0, 0, 1)):
        assert main(["--model-config", "llama3-8b", "--seed", str(seed), "--out", str(path)]) == 0
    first, again, other = (read_head_scores(p) for p in paths)
    first.check_shape(32, 8, range(32))
    assert all(0.0 <= s < 1.0 for row in first.scores for s in row)
    assert first.scores == again.scores != other.scores
    assert "synthetic" in first.scoring
    source = load_model_source(write_model_config("llama3-8b"), None, "dummy")
    first.check_model(model_identity(source.path, source.hf_config.to_dict()))
    qwen = load_model_source(write_model_config("qwen3-8b"), None, "dummy")
    with pytest.raises(ValueError, match="another model"):
        first.check_model(model_identity(qwen.path, qwen.hf_config.to_dict()))
