"""`bench throughput` on the MLA families: the GLM-4.7-Flash and Moonlight (DeepSeek-V3
architecture) presets build and decode with dummy weights, the roofline counts only the
routed experts a step reads (shared experts are read whole) and the latent KV bytes,
and transformers' generate runs on the engine's own weights (HF parameter names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsevllm.cli import main
from tiny_mla import save_tiny_mla

SHRINK = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    vocab_size=512,
)


@pytest.mark.parametrize("preset", ["glm-4.7-flash", "moonlight-16b-a3b"])
def test_mla_presets_run_with_dummy_weights(monkeypatch, tmp_path: Path, preset) -> None:
    import sparsevllm.bench.model_configs as model_configs

    tiny = {**model_configs.MODEL_CONFIGS[preset], **SHRINK}  # the keys and the family kept
    if "mlp_layer_types" in tiny:
        tiny["mlp_layer_types"] = ["dense", "sparse", "sparse"]
    if tiny.get("q_lora_rank"):
        tiny["q_lora_rank"] = 48
    monkeypatch.setitem(model_configs.MODEL_CONFIGS, preset, tiny)
    out = tmp_path / "preset.json"
    args = ["bench", "throughput", "--model-config", preset, "--prompt-len", "16"]
    args += ["--output-len", "4", "--batch-size", "4", "--dtype", "float32", "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["model"] == preset and r["decode_tokens_per_s"] > 0
    assert r["kv_bytes_per_slot"] == 3 * (32 + 8) * 4  # one latent row per layer, fp32
    moe = r["moe"]
    assert moe["moe_layers"] == 2 and moe["experts"] == tiny["n_routed_experts"]
    assert moe["experts_per_token"] == tiny["num_experts_per_tok"]
    assert moe["weight_bytes_all_experts"] > r["weight_bytes_per_step"]  # unrouted skipped


def test_transformers_runs_on_the_engines_weights(tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    args = ["bench", "throughput", "--model", save_tiny_mla("deepseek_v3", tmp_path / "m")]
    args += ["--prompt-len", "12", "--output-len", "3", "--batch-size", "2"]
    args += ["--dtype", "float32", "--compare", "hf", "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text())["hf"]["end_to_end_tokens_per_s"] > 0
