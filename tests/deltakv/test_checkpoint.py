"""Compressor checkpoints: a round trip keeps weights, spec and model; another model's
checkpoint is refused with both fingerprints named; damaged files fail clearly."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparsevllm.calibration.identity import config_fingerprint
from sparsevllm.calibration.schema import ModelIdentity
from sparsevllm.deltakv.checkpoint import (
    CompressorMismatch,
    load_compressor,
    read_info,
    save_compressor,
)
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.spec import DeltaKVSpec

SPEC = DeltaKVSpec(layers=(0, 2, 5), num_kv_heads=2, head_dim=8, latent_dims=(4, 6, 8))
SMOL = ModelIdentity(
    ("smol.gguf",), config_fingerprint({"model_type": "llama", "hidden_size": 576})
)
GEMMA = ModelIdentity(
    ("gemma.gguf",), config_fingerprint({"model_type": "gemma3", "hidden_size": 640})
)


@pytest.fixture
def compressor() -> DeltaKVCompressor:
    torch.manual_seed(0)
    return DeltaKVCompressor(SPEC)


def test_round_trip_keeps_weights_spec_and_model(tmp_path, compressor):
    path = tmp_path / "c.safetensors"
    save_compressor(path, compressor, SMOL, {"steps": 7})
    loaded, info = load_compressor(path, SMOL)
    assert info.spec == SPEC and info.model == SMOL and info.training == {"steps": 7}
    for (name, a), (name_b, b) in zip(compressor.state_dict().items(), loaded.state_dict().items()):
        assert name == name_b and torch.equal(a, b)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert sorted(f.keys())[0] == "layers.0.down_proj.bias"
    assert meta["format"] == "sparsevllm-deltakv-compressor" and meta["version"] == "1"
    assert meta["model_fingerprint"] == SMOL.fingerprint
    assert read_info(path).spec.latent_dims == (4, 6, 8)


def test_float16_save_is_half_the_size(tmp_path):
    compressor = DeltaKVCompressor(
        DeltaKVSpec(layers=(0,), num_kv_heads=2, head_dim=64, latent_dims=(32,))
    )
    save_compressor(tmp_path / "a.safetensors", compressor, SMOL, dtype="float32")
    save_compressor(tmp_path / "b.safetensors", compressor, SMOL, dtype="float16")
    a, b = (tmp_path / "a.safetensors").stat().st_size, (tmp_path / "b.safetensors").stat().st_size
    assert b < 0.6 * a
    loaded, _ = load_compressor(tmp_path / "b.safetensors")
    assert loaded.codec(0).down_proj.weight.dtype == torch.float32  # loads in float32
    ref = compressor.codec(0).down_proj.weight.half().float()
    assert torch.equal(loaded.codec(0).down_proj.weight, ref)


def test_loading_for_another_model_names_both_fingerprints(tmp_path, compressor):
    path = tmp_path / "c.safetensors"
    save_compressor(path, compressor, SMOL)
    with pytest.raises(CompressorMismatch) as err:
        load_compressor(path, GEMMA)
    message = str(err.value)
    assert SMOL.fingerprint in message and GEMMA.fingerprint in message
    assert "smol.gguf" in message and "gemma.gguf" in message


def test_a_file_that_is_no_checkpoint_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_info(junk)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other), metadata={"format": "something"})
    with pytest.raises(ValueError, match="not a DeltaKV compressor checkpoint"):
        load_compressor(other)
    with pytest.raises(FileNotFoundError, match="no compressor checkpoint"):
        read_info(tmp_path / "missing.safetensors")


def test_weights_that_do_not_match_the_spec_are_refused(tmp_path, compressor):
    path = tmp_path / "c.safetensors"
    save_compressor(path, compressor, SMOL)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("layers.5.")}
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ValueError, match="missing"):
        load_compressor(path)


def test_saving_needs_a_fingerprint(tmp_path, compressor):
    with pytest.raises(ValueError, match="fingerprint"):
        save_compressor(tmp_path / "c.safetensors", compressor, ModelIdentity(("x",), None))
