"""EngineConfig validation and the unknown-key suggestions."""

from __future__ import annotations

import json

import pytest

from sparsevllm import EngineConfig


def test_unknown_key_names_closest_field():
    with pytest.raises(ValueError, match=r"unknown config key 'max_num_seq'.*'max_num_seqs'"):
        EngineConfig.from_dict({"max_num_seq": 4})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_num_seqs": -1}, "max_num_seqs must be a positive integer"),
        ({"num_kv_slots": 0}, "num_kv_slots must be a positive integer"),
        ({"chunk_prefill_size": 4096, "max_num_batched_tokens": 1024}, "must not exceed"),
        ({"dtype": "float33"}, "dtype must be one of.*did you mean 'float32'"),
        ({"load_format": "safetensor"}, "load_format must be one of"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"max_model_len": True}, "max_model_len must be a number"),
        ({"device": "tpu"}, "device must be"),
        ({"sparse_method": "snapkvv"}, "unknown sparse_method"),
        ({"kv_cache_memory_gb": -2.0}, "kv_cache_memory_gb must be > 0"),
        ({"cpu_offload_gb": 1, "enable_prefix_caching": False}, "needs prefix caching"),
        ({"disk_offload_dir": "/tmp/x", "enable_prefix_caching": False}, "needs prefix caching"),
    ],
)
def test_bad_values_fail_at_construction(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(values)


def test_json_round_trip_and_overrides(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"max_num_seqs": 3, "chunk_prefill_size": 64}))
    cfg = EngineConfig.from_json(path, max_num_seqs=5)
    assert cfg.max_num_seqs == 5 and cfg.chunk_prefill_size == 64
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    path.write_text(json.dumps({"chunk_prefil_size": 64}))
    with pytest.raises(ValueError, match="did you mean 'chunk_prefill_size'"):
        EngineConfig.from_json(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_json(path)


def test_config_is_frozen_and_method_alias_is_canonical():
    cfg = EngineConfig(sparse_method="dense")
    assert cfg.sparse_method == "vanilla"
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 2  # type: ignore[misc]


def test_offload_tiers_work_with_either_cache():
    for method in ("vanilla", "quest", "snapkv"):  # radix, radix, chain
        config = EngineConfig(sparse_method=method, cpu_offload_gb=1, disk_offload_dir="/tmp/x")
        assert config.disk_offload_dir == "/tmp/x"


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"prefill_sparse_method": "minference"},
            "prefill_sparse_method must be one of off, vertical_slash; got 'minference'",
        ),
        ({"prefill_sparse_method": "vertical-slash"}, "did you mean 'vertical_slash'"),
        ({"prefill_sparse_min_len": 0}, "prefill_sparse_min_len must be a positive integer"),
        ({"prefill_sparse_vertical_blocks": -1}, "prefill_sparse_vertical_blocks must be >= 0"),
        ({"prefill_sparse_slash_blocks": -3}, "prefill_sparse_slash_blocks must be >= 0"),
        ({"prefill_sparse_slash_blocks": 1.5}, "prefill_sparse_slash_blocks has the wrong type"),
        ({"prefill_sparse_last_q": 0}, "prefill_sparse_last_q must be a positive integer"),
        (
            {"prefill_sparse_last_q": 512, "prefill_sparse_min_len": 256},
            r"prefill_sparse_last_q \(512\) must not exceed prefill_sparse_min_len \(256\)",
        ),
    ],
)
def test_bad_prefill_sparse_settings(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(values)


def test_prefill_sparse_settings_reach_the_backends():
    from sparsevllm.attention.sparse_prefill import PrefillSparsity
    from sparsevllm.engine.runner import prefill_sparsity_of

    assert prefill_sparsity_of(EngineConfig()) is None
    config = EngineConfig.create(
        prefill_sparse_method="vertical_slash",
        prefill_sparse_vertical_blocks=0,
        sparse_method="snapkv",
    )
    assert prefill_sparsity_of(config) == PrefillSparsity(vertical_blocks=0)
