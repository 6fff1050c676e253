"""GGUF files of llama.cpp's `deepseek2` architecture -> the HF config and weights of
DeepSeek-V3 (`deepseek_v3`) or GLM-4.7-Flash (`glm4_moe_lite`).

transformers has no GGUF mapping for `deepseek2`, so the config is built here from the
metadata, and the tensors are renamed to HF names (gguf_loader.py does the loop). The
rules follow llama.cpp's converter (`DeepseekV2Model` in convert_hf_to_gguf.py, which
`Glm4MoeLiteModel` subclasses unchanged but for the tokenizer) and its loader
(`llama_model_deepseek2::load_arch_hparams` / `load_arch_tensors`):

- attention: the converter writes MLA as MQA over the latent rows, so
  `attention.head_count_kv` is 1, `key_length` is kv_lora_rank + rope and
  `value_length` is kv_lora_rank; the per-head sizes are `key_length_mla`
  (qk_nope + qk_rope) and `value_length_mla` (v_head_dim). Older files lack the
  `_mla` keys and state the per-head sizes in `key_length` / `value_length` (llama.cpp
  falls back the same way). `rope.dimension_count` is qk_rope_head_dim.
- `kv_b_proj` is split by the converter into `attn_k_b` `[H, kv_lora_rank, qk_nope]`
  (each head's W_uk transposed) and `attn_v_b` `[H, v_head_dim, kv_lora_rank]` (torch
  order); they are joined back here. Older files hold `attn_kv_b` as HF has it.
- no rope permutation: llama.cpp rotates deepseek2 as adjacent pairs ("normal" rope),
  which is HF's `rope_interleave=True`, and the converter leaves q_b / kv_a as they are.
  So `rope_interleave` is always true: a GGUF cannot say otherwise.
- experts are stacked `[E, out, in]` (`ffn_{gate,up,down}_exps`), as for qwen3moe; the
  score-correction bias is `exp_probs_b.bias` (llama.cpp may do without it: zeros then,
  which is what it computes); shared experts are `ffn_*_shexp`.
- routing: `expert_used_count`, `expert_group_count` / `expert_group_used_count` (absent:
  one group), `expert_weights_norm` (absent: false), `expert_weights_scale` (absent or 0:
  no scaling). `expert_gating_func` is 2 (sigmoid) or 1 (softmax). Absent, llama.cpp
  takes sigmoid for GLM-4.7-Flash (47 or 48 layers and a 154,880-token vocabulary: its
  config has no `scoring_func`, so the converter writes no key) and softmax otherwise
  (DeepSeek-V2 / V2.5). Our MoE block only does sigmoid: softmax is refused.
- YaRN: `rope.scaling.type` yarn, `factor`, `original_context_length`,
  `yarn_beta_fast` / `yarn_beta_slow`, and `yarn_log_multiplier` = 0.1 * mscale_all_dim.
  HF's `mscale` is not stored; llama.cpp puts no YaRN factor on cos and sin for
  deepseek2, which is HF's mscale == mscale_all_dim (both 1.0 on DeepSeek-V3), so that
  is what is rebuilt.

Which config class: `glm4_moe_lite` when the file says GLM (`tokenizer.ggml.pre` is
"glm4", the converter's name for GLM-4.5 / 4.7 vocabularies, or `general.name` /
`general.basename` contains "glm"), else `deepseek_v3` (DeepSeek-V3/R1, Kimi K2, ...).
The two run the same network here (registry.py), so a wrong guess changes only the
reported architecture. GLM's dense layers come back as `mlp_layer_types` from
`leading_dense_block_count` (llama.cpp can only express leading dense layers).

Refused with the key named: softmax gating, dense-only files (no `expert_count`),
Mistral-Large-3's attention temperature, YaRN extrapolation or attention factors other
than 1, rope scalings other than YaRN.
"""

from __future__ import annotations

from typing import Any

import gguf
import torch
import transformers

from sparsevllm.models.gguf_file import GGUFFile

MLA_ARCH = "deepseek2"

# Placeholders for the split kv_b halves until `finish_mla_state_dict` joins them.
_K_B = "self_attn.kv_b_proj.k_b"
_V_B = "self_attn.kv_b_proj.v_b"
_KV_B = "self_attn.kv_b_proj.weight"
_ROUTER = "mlp.gate.weight"
_ROUTER_BIAS = "mlp.gate.e_score_correction_bias"

# Per-block tensors, relative to `blk.{i}.` / `model.layers.{i}.`. The stacked expert
# gate and up names are the ones gguf_loader's `_join_expert_gate_up` joins.
MLA_BLOCK_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",  # no q LoRA (q_lora_rank absent)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": _KV_B,  # older files: the unsplit HF tensor
    "attn_k_b.weight": _K_B,
    "attn_v_b.weight": _V_B,
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",  # the leading dense layers
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": _ROUTER,
    "exp_probs_b.bias": _ROUTER_BIAS,
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}

_HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
# llama.cpp's defaults where a key is absent (llama_hparams / its deepseek2 loader).
_ROPE_THETA = 10000.0
_YARN_BETA_FAST, _YARN_BETA_SLOW = 32.0, 1.0
# llama.cpp's rule for a deepseek2 file without expert_gating_func: GLM-4.7-Flash's shape.
_GLM47_FLASH_LAYERS, _GLM47_FLASH_VOCAB = (47, 48), 154880
_SIGMOID, _SOFTMAX = gguf.ExpertGatingFuncType.SIGMOID, gguf.ExpertGatingFuncType.SOFTMAX
# Keys whose llama.cpp meaning our model does not reproduce, with the neutral value.
_NEUTRAL_KEYS: dict[str, float | None] = {
    "attention.temperature_scale": None,  # Mistral-Large-3's llama-4 query scaling
    "rope.scaling.yarn_ext_factor": 1.0,
    "rope.scaling.yarn_attn_factor": 1.0,
}


def _key(name: str) -> str:
    return f"{MLA_ARCH}.{name}"


def _required(meta: dict[str, Any], name: str) -> Any:
    if _key(name) not in meta:
        raise ValueError(f"GGUF file lacks required metadata {_key(name)!r}")
    return meta[_key(name)]


def mla_model_type(meta: dict[str, Any]) -> str:
    """`glm4_moe_lite` when the file says GLM (see the module docstring), else
    `deepseek_v3`."""
    names = " ".join(str(meta.get(k, "")) for k in ("general.name", "general.basename"))
    if meta.get("tokenizer.ggml.pre") == "glm4" or "glm" in names.lower():
        return "glm4_moe_lite"
    return "deepseek_v3"


def mla_config(parsed: GGUFFile) -> transformers.PretrainedConfig:
    """The HF config (DeepseekV3Config or Glm4MoeLiteConfig) of a `deepseek2` file."""
    values = mla_config_dict(parsed)
    return transformers.AutoConfig.for_model(**values)


def mla_config_dict(parsed: GGUFFile) -> dict[str, Any]:
    meta = parsed.metadata
    _refuse_unsupported(meta)
    model_type = mla_model_type(meta)
    n_layers = int(_required(meta, "block_count"))
    heads = int(_required(meta, "attention.head_count"))
    values: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_HF_CLASSES[model_type]],
        "vocab_size": _vocab_size(parsed),
        "hidden_size": int(_required(meta, "embedding_length")),
        "intermediate_size": int(_required(meta, "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        # The converter writes 1 (MQA over latent rows); HF checkpoints say `heads`.
        "num_key_value_heads": heads,
        "max_position_embeddings": int(_required(meta, "context_length")),
        "rms_norm_eps": float(_required(meta, "attention.layer_norm_rms_epsilon")),
        "hidden_act": "silu",  # llama.cpp's deepseek2 graph has no other
        "attention_bias": False,  # nor biases (a bias tensor would be an unknown name)
        "rope_parameters": _rope_parameters(meta),
        "rope_interleave": True,  # llama.cpp's "normal" (adjacent-pair) rope, unpermuted
        "tie_word_embeddings": "output.weight" not in parsed.tensor_names,
        **_attention_sizes(meta),
        **_moe_values(meta, n_layers, model_type),
    }
    _check_gating(meta, n_layers, values["vocab_size"])
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{key}" in meta:
            values[f"{name}_token_id"] = int(meta[f"tokenizer.ggml.{key}"])
    return values


def _vocab_size(parsed: GGUFFile) -> int:
    """`deepseek2.vocab_size`, else the token list's length, else the embedding's rows
    (the order llama.cpp reads the vocabulary size in)."""
    meta = parsed.metadata
    if _key("vocab_size") in meta:
        return int(meta[_key("vocab_size")])
    if "tokenizer.ggml.tokens" in meta:
        return len(meta["tokenizer.ggml.tokens"])
    embedding = next((t for t in parsed.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ValueError(f"GGUF file lacks {_key('vocab_size')!r} and token_embd.weight")
    return int(embedding.shape[0])


def _attention_sizes(meta: dict[str, Any]) -> dict[str, Any]:
    """The MLA sizes: per-head sizes from the `_mla` keys when present (files written
    since llama.cpp's MLA cache), else from key_length / value_length (older files)."""
    rope = int(_required(meta, "rope.dimension_count"))
    key_name = "attention.key_length_mla"
    key_length = meta.get(_key(key_name), meta.get(_key("attention.key_length")))
    value_length = meta.get(
        _key("attention.value_length_mla"), meta.get(_key("attention.value_length"))
    )
    if key_length is None or value_length is None:
        raise ValueError(f"GGUF file lacks {_key(key_name)!r} and {_key('attention.key_length')!r}")
    if int(key_length) <= rope:
        raise ValueError(
            f"{_key(key_name)} = {key_length} leaves no non-rope channels beside {rope} rope ones"
        )
    q_lora = meta.get(_key("attention.q_lora_rank"))  # absent: q_proj, no q LoRA
    return {
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(_required(meta, "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key_length) - rope,
        "v_head_dim": int(value_length),
    }


def _moe_values(meta: dict[str, Any], n_layers: int, model_type: str) -> dict[str, Any]:
    """Experts, routing and which layers are dense, with llama.cpp's defaults."""
    if _key("expert_count") not in meta:
        raise ValueError(
            f"GGUF file lacks {_key('expert_count')!r}: dense-only deepseek2 models "
            "(e.g. Youtu-LLM) are not supported"
        )
    dense = int(meta.get(_key("leading_dense_block_count"), 0))
    n_group = int(meta.get(_key("expert_group_count"), 0) or 1)
    values: dict[str, Any] = {
        "n_routed_experts": int(meta[_key("expert_count")]),
        "num_experts_per_tok": int(_required(meta, "expert_used_count")),
        "n_shared_experts": int(meta.get(_key("expert_shared_count"), 0)),
        "moe_intermediate_size": int(_required(meta, "expert_feed_forward_length")),
        "n_group": n_group,
        "topk_group": int(meta.get(_key("expert_group_used_count"), 0) or n_group),
        "norm_topk_prob": bool(meta.get(_key("expert_weights_norm"), False)),
        # llama.cpp skips the scaling when the key is absent or 0.
        "routed_scaling_factor": float(meta.get(_key("expert_weights_scale"), 0.0) or 1.0),
    }
    if model_type == "glm4_moe_lite":
        values["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (n_layers - dense)
    else:
        values["first_k_dense_replace"] = dense
    return values


def _check_gating(meta: dict[str, Any], n_layers: int, vocab_size: int) -> None:
    """Refuse every gating function but sigmoid (layers/moe_shared.py's only one)."""
    key = _key("expert_gating_func")
    if key in meta:
        value, origin = int(meta[key]), f"{key} = {meta[key]}"
    elif n_layers in _GLM47_FLASH_LAYERS and vocab_size == _GLM47_FLASH_VOCAB:
        return  # llama.cpp: GLM-4.7-Flash's files carry no key and route by sigmoid
    else:
        value, origin = _SOFTMAX, f"{key} is absent, which llama.cpp reads as softmax"
    if value == _SIGMOID:
        return
    names = {int(t): t.name.lower() for t in gguf.ExpertGatingFuncType}
    raise ValueError(
        f"unsupported MoE gating in GGUF metadata: {origin} ({names.get(value, 'unknown')}); "
        f"only sigmoid ({int(_SIGMOID)}, DeepSeek-V3 / GLM-4.7-Flash routing) is implemented "
        "(softmax is DeepSeek-V2's)"
    )


def _refuse_unsupported(meta: dict[str, Any]) -> None:
    for name, neutral in _NEUTRAL_KEYS.items():
        value = meta.get(_key(name))
        if value is not None and (neutral is None or float(value) != neutral):
            raise ValueError(f"unsupported GGUF metadata {_key(name)} = {value!r}")


def _rope_parameters(meta: dict[str, Any]) -> dict[str, Any]:
    """transformers' `rope_parameters` for what llama.cpp computes from the rope keys."""
    theta = float(meta.get(_key("rope.freq_base"), _ROPE_THETA))
    scaling = meta.get(_key("rope.scaling.type"), "none")
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise ValueError(f"unsupported {_key('rope.scaling.type')} {scaling!r} (none or yarn)")
    params: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(_required(meta, "rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _required(meta, "rope.scaling.original_context_length")
        ),
        "beta_fast": float(meta.get(_key("rope.scaling.yarn_beta_fast"), _YARN_BETA_FAST)),
        "beta_slow": float(meta.get(_key("rope.scaling.yarn_beta_slow"), _YARN_BETA_SLOW)),
    }
    # The converter stores 0.1 * mscale_all_dim as float32: rounded back to 6 places so
    # that 0.8 reads 0.8, not 0.8000000119.
    mscale = round(10.0 * float(meta.get(_key("rope.scaling.yarn_log_multiplier"), 0.0)), 6)
    if mscale:  # HF: cos/sin x mscale / mscale_all_dim = 1; scores x mscale(factor)^2
        params.update(mscale=mscale, mscale_all_dim=mscale)
    else:  # llama.cpp: neither factor; HF would put its default mscale on cos and sin
        params["attention_factor"] = 1.0
    return params


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """`attn_k_b` `[H, R, Dn]` and `attn_v_b` `[H, Dv, R]` -> HF's `kv_b_proj.weight`
    `[H * (Dn + Dv), R]` (per head: the Dn W_uk rows, then the Dv W_uv rows)."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise ValueError(
            f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} are not "
            "[heads, kv_lora_rank, qk_nope] and [heads, v_head_dim, kv_lora_rank]"
        )
    per_head = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, Dn + Dv, R]
    return per_head.reshape(-1, per_head.shape[-1]).contiguous()


def finish_mla_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Join each layer's k_b / v_b into `kv_b_proj.weight` (a file that also holds the
    unsplit tensor keeps that one) and give routers without `exp_probs_b` a zero bias."""
    for k_name in [k for k in state if k.endswith(_K_B)]:
        prefix = k_name[: -len(_K_B)]
        if prefix + _V_B not in state:
            raise ValueError(f"GGUF file has the attn_k_b of {prefix!r} but no attn_v_b")
        k_b, v_b = state.pop(k_name), state.pop(prefix + _V_B)
        state.setdefault(prefix + _KV_B, join_kv_b(k_b, v_b))
    stray = [k for k in state if k.endswith(_V_B)]
    if stray:
        raise ValueError(
            f"GGUF file has the attn_v_b of {stray[0][: -len(_V_B)]!r} but no attn_k_b"
        )
    for router in [k for k in state if k.endswith(_ROUTER)]:
        bias = router[: -len(_ROUTER)] + _ROUTER_BIAS
        if bias not in state:
            state[bias] = torch.zeros(state[router].shape[0], dtype=state[router].dtype)
    return state
