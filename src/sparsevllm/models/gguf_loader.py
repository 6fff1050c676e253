"""Load GGUF checkpoints (llama.cpp format) as Hugging Face config, weights and tokenizer.

The engine's model code uses Hugging Face parameter names, so a GGUF file is
translated here once: tensors are dequantized to float with the ``gguf`` library,
reshaped to the HF ``[out_features, in_features]`` layout, renamed, and the
layout changes that llama.cpp's converter applies (rotary row permutation for
``llama``, ``+1`` on Gemma norm weights) are undone so the result equals the
original HF checkpoint (up to quantization error). The MLA models' ``deepseek2`` files
(DeepSeek-V3, GLM-4.7-Flash) have a config and a re-layout of their own: gguf_mla.py.
"""

from __future__ import annotations

import copy
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
import transformers

from sparsevllm.models.gguf_dequant import dequantize
from sparsevllm.models.gguf_file import GGUFFile, read_gguf_file
from sparsevllm.models.gguf_mla import (
    MLA_ARCH,
    MLA_BLOCK_TENSORS,
    finish_mla_state_dict,
    mla_config,
)
from sparsevllm.models.gguf_transformers import build_config, build_tokenizer

# gguf ``general.architecture`` -> HF class name written into ``config.architectures``.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    # DeepSeek-V3 (GLM-4.7-Flash files get Glm4MoeLiteForCausalLM: gguf_mla.mla_config).
    MLA_ARCH: "DeepseekV3ForCausalLM",
}

# Tensors outside the transformer blocks (same for every supported architecture).
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_COMMON: dict[str, str] = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
}
_QK_NORM: dict[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# Stacked expert gate and up projections, before they are joined.
_EXPERT_GATE = "mlp.experts.gate_proj"
_EXPERT_UP = "mlp.experts.up_proj"

# Per-block tensors, relative to ``blk.{i}.`` / ``model.layers.{i}.``. Note that
# ``ffn_norm`` means different HF modules: the single post-attention norm of
# llama/qwen, but the *pre*-feed-forward norm of Gemma3 (which has four norms).
_BLOCK_TENSORS: dict[str, dict[str, str]] = {
    "llama": {**_BLOCK_COMMON, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "qwen2": {
        **_BLOCK_COMMON,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    "qwen3": {**_BLOCK_COMMON, **_QK_NORM, "ffn_norm.weight": "post_attention_layernorm.weight"},
    # llama.cpp stacks each projection of all experts in one [E, out, in] tensor; gate
    # and up are joined into `gate_up_proj` after loading (`_join_expert_gate_up`).
    "qwen3moe": {
        **_BLOCK_COMMON,
        **_QK_NORM,
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "ffn_gate_exps.weight": _EXPERT_GATE,
        "ffn_up_exps.weight": _EXPERT_UP,
        "ffn_down_exps.weight": "mlp.experts.down_proj",
    },
    "gemma3": {
        **_BLOCK_COMMON,
        **_QK_NORM,
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    MLA_ARCH: MLA_BLOCK_TENSORS,
}

# llama.cpp-only tensors with no HF parameter: Llama-3.1 ``rope_freqs`` is derived
# from the rope-scaling config on the HF side, so it is skipped, not an error.
_IGNORED_TENSORS: frozenset[str] = frozenset({"rope_freqs.weight"})

# HF ``model_type`` (as produced by transformers' GGUF config parser) -> gguf arch.
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",  # llama.cpp stores Mistral as ``llama``; transformers renames it
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


_CACHE: dict[tuple[Any, ...], Any] = {}
_CACHE_FILES = 2  # files whose parsed contents stay in memory
# The weights are dequantized on a worker thread while the config and tokenizer are
# built (loader._prefetch_gguf_weights): the memo's bookkeeping is done under a lock.
_CACHE_LOCK = threading.Lock()


def _cached(fn: Callable[..., Any], path: str, *args: Any) -> Any:
    """fn(path, *args), memoised per file identity (path, size, mtime): a rewritten file
    is parsed again. Only the last `_CACHE_FILES` files are kept."""
    st = os.stat(path)
    ident = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    key = (fn.__name__, ident, *args)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    value = fn(path, *args)
    with _CACHE_LOCK:
        files = list(dict.fromkeys(k[1] for k in _CACHE))
        if ident not in files and len(files) >= _CACHE_FILES:
            for k in [k for k in _CACHE if k[1] == files[0]]:
                del _CACHE[k]
        return _CACHE.setdefault(key, value)


def read_gguf(path: str) -> GGUFFile:
    """The parsed GGUF file (metadata, tensor table, mapped data), once per file: the
    config, the tokenizer and the weights are all built from this one parse."""
    return _cached(read_gguf_file, path)


def _check_architecture(arch: str) -> None:
    """Raise ``ValueError`` unless ``arch`` is a gguf architecture we can map."""
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; supported architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )


def gguf_to_hf_name(arch: str, gguf_name: str) -> str | None:
    """Map a llama.cpp tensor name to its HF parameter name.

    Returns ``None`` for llama.cpp-only tensors that have no HF counterpart and
    raises ``ValueError`` for names we do not know (silently dropping a weight would
    produce a model that runs but outputs garbage).
    """
    _check_architecture(arch)
    if gguf_name in _IGNORED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is not None and m.group(2) in _BLOCK_TENSORS[arch]:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[arch][m.group(2)]}"
    raise ValueError(
        f"Unknown GGUF tensor {gguf_name!r} for architecture {arch!r} (no Hugging Face mapping)"
    )


def unpermute_rope_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a ``llama`` q/k weight or bias.

    HF Llama uses the "rotate-half" rope: within each head, dimension ``j`` pairs
    with ``j + head_dim/2``. llama.cpp's kernel pairs adjacent rows ``(2j, 2j+1)``,
    so its converter reorders each head's rows as ``[r0, r_h, r1, r_{h+1}, ...]``
    (h = head_dim/2), i.e. viewed as ``[n_head, 2, h]`` it swaps the last two axes.
    Viewing the stored rows as ``[n_head, h, 2]`` and swapping back restores HF
    order. For k, ``n_head`` must be the number of KV heads.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    w = weight.reshape(n_head, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def read_gguf_header(path: str) -> tuple[dict[str, Any], list[str]]:
    """(metadata, tensor names) of a GGUF file, from its one cached parse."""
    parsed = read_gguf(path)
    return parsed.metadata, parsed.tensor_names


def load_gguf_config(path: str) -> transformers.PretrainedConfig:
    """The HF config of a GGUF file (a private copy: callers may adapt it)."""
    return copy.deepcopy(_cached(_load_gguf_config, path))


def _load_gguf_config(path: str) -> transformers.PretrainedConfig:
    """Return the HF config for the GGUF file at ``path``.

    Built as transformers' GGUF metadata parser builds it (from the file's one parse,
    see gguf_transformers.py), then patched where it falls
    short for the engine: ``architectures`` is never set by it; ``rope_theta``
    only lives in ``rope_parameters`` in transformers 5; ``head_dim`` is not read
    for qwen2/qwen3 (the Qwen3Config default of 128 is wrong for other sizes, and
    Qwen2Config has no ``head_dim`` attribute), so it is always set here;
    ``tie_word_embeddings`` is pinned to "no ``output.weight`` tensor", the same
    rule :func:`load_gguf_state_dict` uses to leave ``lm_head`` out.
    """
    parsed = read_gguf(path)
    meta, tensor_names, arch = parsed.metadata, parsed.tensor_names, parsed.architecture
    _check_architecture(arch)
    if arch == MLA_ARCH:  # transformers has no GGUF mapping for it: built from scratch
        return mla_config(parsed)
    config = build_config(parsed)
    if _MODEL_TYPE_TO_ARCH.get(config.model_type) != arch:
        raise ValueError(f"GGUF {arch!r} parsed as unexpected model_type {config.model_type!r}")
    if not getattr(config, "architectures", None):
        config.architectures = [SUPPORTED_ARCHITECTURES[arch]]
    if getattr(config, "rope_theta", None) is None:
        rope = getattr(config, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope)  # gemma3 keeps one dict per layer type
        if "rope_theta" in rope:
            config.rope_theta = rope["rope_theta"]
    if f"{arch}.attention.key_length" in meta:
        config.head_dim = int(meta[f"{arch}.attention.key_length"])
    elif getattr(config, "head_dim", None) is None:  # e.g. Qwen2Config has no head_dim at all
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.tie_word_embeddings = "output.weight" not in tensor_names
    if arch == "gemma3":
        _fix_gemma3_config(config, meta)
    if arch == "qwen3moe":
        # transformers' parser has no key for the experts' size (it keeps the class
        # default, 768, which is Qwen3-30B-A3B's but not every model's).
        config.moe_intermediate_size = _metadata_int(meta, f"{arch}.expert_feed_forward_length")
    return config


# llama.cpp identifies Gemma-3-27B by its layer count and scales its attention by
# 1/sqrt(hidden / heads) = 1/sqrt(168) instead of 1/sqrt(head_dim).
_GEMMA3_27B_LAYERS = 62


def _fix_gemma3_config(config: transformers.PretrainedConfig, meta: dict[str, Any]) -> None:
    """Fill in what transformers' GGUF parser leaves at Gemma3TextConfig defaults.

    llama.cpp hard-codes for gemma3 what the HF config spells out: the sliding-window
    pattern (every 6th layer global, as HF's default), the local RoPE base (10000,
    unscaled, as HF's default) and the attention scale; and it stores the global
    layers' RoPE scaling (linear x8 on 4B+) as ``gemma3.rope.scaling.*``, which the
    parser drops.
    """
    window = int(meta.get("gemma3.attention.sliding_window", 0) or 0)
    if window <= 0:  # llama.cpp: no window key (or 0) means every layer is global
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    scaling = meta.get("gemma3.rope.scaling.type")
    if scaling == "linear":
        linear = {"rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
        full = (getattr(config, "rope_parameters", None) or {}).get("full_attention")
        if full is not None:  # transformers 5: one dict per layer type
            full.update(linear)
        else:  # transformers 4: rope_scaling applies to the global layers only
            config.rope_scaling = linear
    elif scaling not in (None, "none"):
        raise ValueError(f"unsupported gemma3 rope scaling {scaling!r} in GGUF metadata")
    # Elsewhere llama.cpp uses head_dim, which is 256 (transformers' default) on every
    # released Gemma 3 but the 27B (head_dim 128, scalar 168), so only that one is set.
    if config.num_hidden_layers == _GEMMA3_27B_LAYERS:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads


def _metadata_int(meta: dict[str, Any], key: str) -> int:
    """Read an integer metadata field, with a clear error when it is missing."""
    if key not in meta:
        raise ValueError(f"GGUF file lacks required metadata {key!r}")
    return int(meta[key])


def load_gguf_state_dict(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dequantized HF-named tensors of a GGUF file (cached: the loader only copies from
    them, and parsing a file takes seconds, e.g. for every engine of a quality sweep)."""
    return dict(_cached(_load_gguf_state_dict, path, dtype))


def _load_gguf_state_dict(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of a GGUF file into an HF-named state dict.

    Tied checkpoints (no ``output.weight``) get no ``lm_head.weight`` entry; the
    model ties it to ``model.embed_tokens.weight`` itself.
    """
    parsed = read_gguf(path)
    arch, meta = parsed.architecture, parsed.metadata
    _check_architecture(arch)
    n_head = n_head_kv = 0
    if arch == "llama":  # only llama's converter permutes q/k rows
        n_head = _metadata_int(meta, "llama.attention.head_count")
        n_head_kv = int(meta.get("llama.attention.head_count_kv", n_head))

    state: dict[str, torch.Tensor] = {}
    for tensor in parsed.tensors:
        hf_name = gguf_to_hf_name(arch, tensor.name)
        if hf_name is None:
            continue
        array = dequantize(parsed.tensor_data(tensor), tensor.ggml_type, tensor.shape)
        weight = torch.from_numpy(array)
        if arch == "llama" and tensor.name.startswith("blk."):
            if ".attn_q." in tensor.name:
                weight = unpermute_rope_rows(weight, n_head)
            elif ".attn_k." in tensor.name:
                weight = unpermute_rope_rows(weight, n_head_kv)
        if arch == "gemma3" and tensor.name.endswith("norm.weight"):
            # HF Gemma RMSNorm scales by (1 + w); llama.cpp bakes the +1 into w.
            weight = weight - 1.0
        state[hf_name] = weight.to(dtype)
    if arch == MLA_ARCH:
        state = finish_mla_state_dict(state)
    return _join_expert_gate_up(state)


def _join_expert_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's stacked expert gate `[E, I, H]` and up `[E, I, H]` -> the model's
    `mlp.experts.gate_up_proj` `[E, 2I, H]` (gate rows first, as transformers' layout)."""
    for gate_name in [k for k in state if k.endswith(_EXPERT_GATE)]:
        prefix = gate_name[: -len(_EXPERT_GATE)]
        up_name = prefix + _EXPERT_UP
        if up_name not in state:
            raise ValueError(f"GGUF file has {gate_name} but no {up_name}")
        gate, up = state.pop(gate_name), state.pop(up_name)
        state[prefix + "mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
    stray = [k for k in state if k.endswith(_EXPERT_UP)]
    if stray:
        raise ValueError(f"GGUF file has {stray[0]} but no expert gate projection")
    return state


def load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """The GGUF file's tokenizer (one shared instance per file: tokenizers are not
    modified by the engine)."""
    return _cached(_load_gguf_tokenizer, path)


def _load_gguf_tokenizer(path: str) -> transformers.PreTrainedTokenizerBase:
    """Build a fast HF tokenizer (with the chat template, if any) from GGUF metadata."""
    tokenizer = build_tokenizer(read_gguf(path))
    check_tokenizer_merges(tokenizer, os.path.basename(path))
    return tokenizer


# Common English words: a vocabulary that holds " word" as one piece must encode it so.
_PROBE_WORDS = ("the", "and", "of", "is", "for", "in", "to", "number")
_SPACE_MARKS = ("\u2581", "\u0120")  # SentencePiece's and byte-level BPE's space markers


def check_tokenizer_merges(tokenizer: transformers.PreTrainedTokenizerBase, name: str) -> None:
    """Refuse a tokenizer that does not produce its own vocabulary's word pieces.

    Some transformers releases (5.17 was seen) build Gemma 3's GGUF tokenizer with broken
    merges: text round-trips, but " the" becomes several sub-word ids the model never saw
    in training, so every prompt reaches the model garbled and answers degrade silently.
    """
    vocab = tokenizer.get_vocab()
    expected = []
    for word in _PROBE_WORDS:
        piece = next((m + word for m in _SPACE_MARKS if m + word in vocab), None)
        if piece is None:
            return  # an unusual vocabulary: the probe does not apply
        expected.append(vocab[piece])
    got = tokenizer.encode(" " + " ".join(_PROBE_WORDS), add_special_tokens=False)
    if got != expected:
        raise ValueError(
            f"the tokenizer that transformers {transformers.__version__} builds from {name} "
            f"encodes {' '.join(_PROBE_WORDS)!r} as {got} instead of its vocabulary's own "
            f"pieces {expected}: prompts would reach the model garbled. Use a transformers "
            "release whose GGUF converter handles this model (5.24 does)."
        )
