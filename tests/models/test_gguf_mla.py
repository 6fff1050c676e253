"""GGUF files of MLA models (llama.cpp's `deepseek2`: DeepSeek-V3, GLM-4.7-Flash).

Each tiny random HF model of tests/tiny_mla.py is written to GGUF the way llama.cpp's
converter (`DeepseekV2Model`, convert_hf_to_gguf.py) lays it out, re-derived here from
its rules: tensor names from gguf's own `TensorNameMap`, kv_b_proj split into attn_k_b
(transposed) and attn_v_b, experts stacked, the score-correction bias as
`exp_probs_b.bias`, MLA as MQA in the metadata (head_count_kv 1, key/value lengths of
the latent rows, per-head sizes in the `_mla` keys), `yarn_log_multiplier` =
0.1 * mscale_all_dim. F32 tensors, so the loaded weights must equal the HF ones exactly
and our engine's logits must match transformers'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from sparsevllm import LLM
from sparsevllm.models.gguf_loader import load_gguf_config, load_gguf_state_dict
from sparsevllm.models.gguf_mla import mla_model_type
from tiny_mla import TINY_DEEPSEEK_V3, build_tiny_mla

ARCH = "deepseek2"
PROMPT = [1, 17, 33, 5, 90, 12, 200, 3, 41, 7]

# What a GGUF can express (llama.cpp computes nothing else): HF's YaRN with mscale equal
# to mscale_all_dim (llama.cpp puts no YaRN factor on cos/sin), interleaved rope, dense
# layers only first. The converter writes the gating function from `scoring_func`,
# which DeepSeek-V3's config.json has (transformers keeps it as an extra attribute);
# GLM's `first_k_dense_replace` is read the same way.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        rope_parameters={**TINY_DEEPSEEK_V3["rope_parameters"], "mscale": 0.8},
        scoring_func="sigmoid",
    ),
    "glm4_moe_lite": dict(
        rope_interleave=True,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        first_k_dense_replace=1,
        scoring_func="sigmoid",
    ),
}
# general.name and tokenizer.ggml.pre as the converter would write them (the GLM one
# names no GLM: the tokenizer's pre-tokenizer name alone marks it).
_NAMES = {"deepseek_v3": ("DeepSeek-V3-tiny", "deepseek-v3"), "glm4_moe_lite": ("tiny", "glm4")}


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    return {k: build_tiny_mla(k, seed=i, **_OVERRIDES[k]) for i, k in enumerate(_OVERRIDES)}


def _write_metadata(w: gguf.GGUFWriter, hp: dict[str, Any], legacy: bool) -> None:
    """The converter's keys for this HF config (`TextModel` + `DeepseekV2Model`)."""
    heads, rope = hp["num_attention_heads"], hp["rope_parameters"]
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads if legacy else 1)  # MLA written as MQA over latent rows
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # scoring_func: sigmoid
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp["q_lora_rank"] is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    rank, nope, v = hp["kv_lora_rank"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    w.add_kv_lora_rank(rank)
    if legacy:  # before llama.cpp's MLA cache: per-head sizes, no _mla keys
        w.add_key_length(nope + hp["qk_rope_head_dim"])
        w.add_value_length(v)
    else:
        w.add_key_length(rank + hp["qk_rope_head_dim"])
        w.add_value_length(rank)
        w.add_key_length_mla(nope + hp["qk_rope_head_dim"])
        w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp["norm_topk_prob"]:  # the converter writes the flag only when it is true
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(hp["qk_rope_head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_tokenizer(w: gguf.GGUFWriter, pre: str, vocab_size: int) -> None:
    """A byte-level BPE vocabulary: single-byte tokens and one merged pair."""
    chars = list(bytes_to_unicode().values())[: vocab_size - 1]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(chars + [chars[3] + chars[4]])
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    w.add_token_types([control if i < 3 else normal for i in range(vocab_size)])
    w.add_token_merges([f"{chars[3]} {chars[4]}"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _gguf_tensors(state: dict[str, torch.Tensor], hp: dict[str, Any], legacy: bool):
    """(gguf name, array) for every HF tensor, as the converter's `modify_tensors` emits."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hp["num_hidden_layers"])
    heads, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    for hf_name, tensor in state.items():
        if hf_name.endswith("experts.gate_up_proj"):  # checkpoints hold gate and up apart
            block = hf_name.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)  # [E, I, H] each
            yield f"blk.{block}.ffn_gate_exps.weight", gate
            yield f"blk.{block}.ffn_up_exps.weight", up
            continue
        if hf_name.endswith("experts.down_proj"):
            hf_name += ".weight"
        if hf_name.endswith("e_score_correction_bias"):  # the converter's rename
            hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        if hf_name.endswith("kv_b_proj.weight") and not legacy:
            k_b, v_b = tensor.view(heads, nope + v, -1).split([nope, v], dim=1)
            for part, data in (("k_b_proj", k_b.transpose(1, 2)), ("v_b_proj", v_b)):
                yield names.get_name(hf_name.replace("kv_b_proj", part), (".weight",)), data
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        yield name, tensor


def _write_gguf(
    path: Path,
    model: torch.nn.Module,
    legacy: bool = False,
    metadata: dict[str, Any] | None = None,
    skip: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """`model` as a GGUF file; `metadata` overrides keys (None drops one), `skip` leaves
    out tensors whose name contains one of its strings, `extra` adds zero tensors."""
    kind = model.config.model_type
    hp = model.config.to_dict()
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(_NAMES[kind][0])
    _write_metadata(w, hp, legacy)
    _write_tokenizer(w, _NAMES[kind][1], hp["vocab_size"])
    for key, value in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if value is not None:
            w.add_key_value(key, value[0], value[1])
    for name, tensor in _gguf_tensors(state, hp, legacy):
        if not any(s in name for s in skip):
            w.add_tensor(name, np.ascontiguousarray(tensor.numpy().astype(np.float32)))
    for name in extra:
        w.add_tensor(name, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


_SAME_FIELDS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads n_routed_experts n_shared_experts "
    "num_experts_per_tok n_group topk_group norm_topk_prob kv_lora_rank q_lora_rank "
    "qk_rope_head_dim qk_nope_head_dim v_head_dim max_position_embeddings rope_interleave "
    "tie_word_embeddings bos_token_id eos_token_id hidden_act attention_bias model_type "
    "rope_parameters"
).split()


def _assert_config_matches(cfg: Any, hf: torch.nn.Module) -> None:
    ref = hf.config
    assert cfg.architectures == [type(hf).__name__]
    for field in _SAME_FIELDS:
        assert getattr(cfg, field) == getattr(ref, field), field
    for field in ("rms_norm_eps", "routed_scaling_factor"):  # stored as float32
        assert getattr(cfg, field) == pytest.approx(getattr(ref, field), rel=1e-7), field
    if ref.model_type == "glm4_moe_lite":
        assert cfg.mlp_layer_types == ref.mlp_layer_types
    else:
        assert cfg.first_k_dense_replace == ref.first_k_dense_replace


@pytest.mark.parametrize("kind", list(_OVERRIDES))
def test_round_trip_and_logits(tmp_path: Path, hf_models: dict, kind: str) -> None:
    hf = hf_models[kind]
    path = tmp_path / f"{kind}.gguf"
    original = _write_gguf(path, hf)
    ours = load_gguf_state_dict(str(path))
    assert set(ours) == set(original)
    for name, tensor in original.items():
        assert torch.equal(ours[name], tensor), name
    cfg = load_gguf_config(str(path))
    _assert_config_matches(cfg, hf)
    llm = LLM(str(path), dtype="float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    got = llm.prompt_logits(PROMPT)
    assert torch.allclose(got, ref, atol=1e-4, rtol=0), (got - ref).abs().max()


def test_legacy_kv_b_and_missing_bias(tmp_path: Path, hf_models: dict) -> None:
    """Files from before llama.cpp's MLA cache hold attn_kv_b and per-head key/value
    lengths; llama.cpp does without exp_probs_b (a zero bias)."""
    hf = hf_models["deepseek_v3"]
    path = tmp_path / "legacy.gguf"
    original = _write_gguf(path, hf, legacy=True, skip=("exp_probs_b",))
    ours = load_gguf_state_dict(str(path))
    assert set(ours) == set(original)
    for name, tensor in original.items():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(ours[name], torch.zeros_like(tensor)), name
        else:
            assert torch.equal(ours[name], tensor), name
    _assert_config_matches(load_gguf_config(str(path)), hf)


def test_config_class_rule() -> None:
    assert mla_model_type({"tokenizer.ggml.pre": "deepseek-v3"}) == "deepseek_v3"
    assert mla_model_type({"tokenizer.ggml.pre": "kimi-k2", "general.name": "Kimi"}) == (
        "deepseek_v3"
    )
    assert mla_model_type({"tokenizer.ggml.pre": "glm4"}) == "glm4_moe_lite"
    assert mla_model_type({"general.basename": "GLM-4.7-Flash"}) == "glm4_moe_lite"


_UINT32 = gguf.GGUFValueType.UINT32
_GATING = f"{ARCH}.expert_gating_func"


def test_glm47_flash_without_gating_key_is_sigmoid(tmp_path: Path, hf_models: dict) -> None:
    """GLM-4.7-Flash's files carry no gating key; llama.cpp then routes by sigmoid for
    its shape (47 layers, 154,880 tokens). Only the config is read here."""
    path = tmp_path / "glm47.gguf"
    shape = {f"{ARCH}.block_count": (47, _UINT32), f"{ARCH}.vocab_size": (154880, _UINT32)}
    _write_gguf(path, hf_models["glm4_moe_lite"], metadata={_GATING: None, **shape})
    cfg = load_gguf_config(str(path))
    assert cfg.model_type == "glm4_moe_lite" and cfg.num_hidden_layers == 47
    assert cfg.mlp_layer_types == ["dense"] + ["sparse"] * 46


@pytest.mark.parametrize(
    "metadata,message",
    [
        ({_GATING: (1, _UINT32)}, r"expert_gating_func = 1 \(softmax\)"),
        ({_GATING: None}, "expert_gating_func is absent, which llama.cpp reads as softmax"),
        ({f"{ARCH}.attention.temperature_scale": (0.1, gguf.GGUFValueType.FLOAT32)}, "temp"),
        ({f"{ARCH}.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)}, "linear"),
        ({f"{ARCH}.expert_count": None}, "deepseek2.expert_count"),
    ],
    ids=["softmax", "gating-absent", "temperature", "linear-rope", "no-experts"],
)
def test_unsupported_metadata_is_refused(
    tmp_path: Path, hf_models: dict, metadata: dict, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    _write_gguf(path, hf_models["deepseek_v3"], metadata=metadata)
    with pytest.raises(ValueError, match=message):
        load_gguf_config(str(path))


def test_unknown_tensor_is_refused(tmp_path: Path, hf_models: dict) -> None:
    path = tmp_path / "mystery.gguf"
    _write_gguf(path, hf_models["glm4_moe_lite"], extra=("blk.1.attn_mystery.weight",))
    with pytest.raises(ValueError, match="blk.1.attn_mystery.weight"):
        load_gguf_state_dict(str(path))
