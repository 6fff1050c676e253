"""The committed compressors (docs/deltakv/): a few MB each, bound to their models, and
the SmolLM2 one reconstructs the default model's K/V on text it never saw."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsevllm.calibration.identity import model_identity
from sparsevllm.cli import main
from sparsevllm.deltakv.checkpoint import CompressorMismatch, load_compressor, read_info
from sparsevllm.models.loader import load_model_source

DOCS = Path(__file__).resolve().parents[2] / "docs" / "deltakv"
SMOL = DOCS / "smollm2" / "compressor.safetensors"
GEMMA = DOCS / "gemma3" / "compressor.safetensors"
GEMMA_R256 = DOCS / "gemma3_r256" / "compressor.safetensors"  # latent kv_dim / 2


def _identity(path: str):
    source = load_model_source(path, None, "auto")
    return model_identity(source.path, source.hf_config.to_dict())


@pytest.fixture(scope="module")
def smol_path() -> str:
    from sparsevllm.models.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from sparsevllm.bench.quality.cli import default_model

    try:
        return default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_the_committed_files_are_small_and_describe_themselves():
    for path, layers, latent in ((SMOL, 30, 96), (GEMMA, 3, 128), (GEMMA_R256, 3, 256)):
        assert path.stat().st_size < 5 * 2**20
        info = read_info(path)
        assert len(info.spec.layers) == layers and set(info.spec.latent_dims) == {latent}
        assert (info.spec.sink_tokens, info.spec.center_stride, info.spec.num_references) == (
            4,
            10,
            4,
        )
        assert info.training["steps"] in (1200, 2000)
    assert read_info(GEMMA).spec.layers == (5, 11, 17)  # Gemma-3-270M's global layers


def test_each_loads_for_its_model_only(smol_path, gemma_path):
    smol, gemma = _identity(smol_path), _identity(gemma_path)
    load_compressor(SMOL, smol)
    load_compressor(GEMMA, gemma)
    load_compressor(GEMMA_R256, gemma)
    with pytest.raises(CompressorMismatch, match=gemma.fingerprint or "?"):
        load_compressor(SMOL, gemma)


def test_the_smollm2_compressor_reconstructs_new_text(smol_path, tmp_path, capsys):
    text = tmp_path / "new.txt"
    text.write_text(
        "Compression of the key-value cache lets a language model keep long documents in "
        "memory. This paragraph was never part of the collected data: it checks that the "
        "committed compressor generalises to text it has not seen, on the default model, "
        "through the same commands a user runs. " * 6
    )
    data = tmp_path / "cap"
    argv = ["deltakv", "collect", "--model", smol_path, "--out", str(data), "--files", str(text)]
    assert main([*argv, "--max-tokens", "512", "--no-progress", "--cpu-threads", "1"]) == 0
    report = tmp_path / "eval.json"
    argv = ["deltakv", "eval", str(SMOL), "--data", str(data), "--split", "all"]
    assert main([*argv, "--json", str(report)]) == 0
    capsys.readouterr()
    mean = json.loads(report.read_text())["mean"]
    assert mean["latent_k"] < 0.5 * mean["references_k"]
    assert mean["latent_v"] < 0.5 * mean["references_v"]
    assert mean["latent_attn"] < 0.5 * mean["references_attn"]
    assert mean["int4_attn"] < 1.2 * mean["latent_attn"]
