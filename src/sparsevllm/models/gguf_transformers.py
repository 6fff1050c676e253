"""transformers' config and tokenizer for a parsed GGUF file, without a parse of its own.

`AutoConfig.from_pretrained(gguf_file=...)` and `AutoTokenizer.from_pretrained(gguf_file=...)`
each read the file again (the config through `gguf.GGUFReader`, several seconds for
SmolLM2, and the tokenizer loader parses the config a second time to pick its class).
The same results are built here from the metadata that `gguf_file.read_gguf_file` has
already read, using transformers' own key tables (`GGUF_TO_TRANSFORMERS_MAPPING`) and
tokenizer converter, so what the engine gets is what those loaders give
(tests/models/test_gguf_loader.py compares both).
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

from sparsevllm.models.gguf_file import GGUFFile

# llama.cpp stores Mistral as `llama`; transformers tells them apart by the model name
# (a name part of "" always matches: llama.cpp's qwen3moe is transformers' qwen3_moe).
_RENAMED_ARCHITECTURES = {"llama": ("mistral", "mistral"), "qwen3moe": ("", "qwen3_moe")}
# Multimodal GGUF checkpoints hold only their text backbone.
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
# The tokenizer class AutoTokenizer picks, where it is not the generic fast tokenizer
# (GemmaTokenizer also registers `<mask>` as a special token).
_TOKENIZER_CLASSES = {"gemma3": "GemmaTokenizer"}
# The tokenizer's special tokens, by the metadata key of their id.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _model_architecture(parsed: GGUFFile) -> str:
    arch = parsed.architecture
    renamed = _RENAMED_ARCHITECTURES.get(arch)
    name = str(parsed.metadata.get("general.name", "")).lower()
    if renamed is not None and renamed[0] in name:
        return renamed[1]
    return arch


def _grouped(
    parsed: GGUFFile, table: dict[str, dict[str, Any]], arch: str | None = None
) -> dict[str, Any]:
    """Metadata renamed by one of transformers' tables ({prefix: {key: hf_name}}); `arch`
    replaces the file's architecture name in keys and string values (as transformers'
    config parser does for Mistral)."""
    arch = arch or parsed.architecture
    out: dict[str, Any] = {}
    for key, value in parsed.metadata.items():
        prefix, _, rest = key.replace(parsed.architecture, arch, 1).partition(".")
        hf_name = table.get(prefix, {}).get(rest)
        if hf_name is None or hf_name == -1:
            continue
        if isinstance(value, str):
            value = value.replace(parsed.architecture, arch)
        out[hf_name] = value
    return out


def config_dict(parsed: GGUFFile) -> dict[str, Any]:
    """The config dict transformers' GGUF parser builds for this file."""
    arch = _model_architecture(parsed)
    values = _grouped(parsed, GGUF_TO_TRANSFORMERS_MAPPING["config"], arch)
    values["tie_word_embeddings"] = "output.weight" not in parsed.tensor_names
    model_type = values.get("model_type", arch)
    values["model_type"] = _TEXT_MODEL_TYPES.get(model_type, model_type)
    # What llama.cpp assumes where the HF class defaults differ (Qwen3-MoE: norm_topk_prob).
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(values["model_type"], {}).items():
        values.setdefault(key, value)
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in parsed.metadata:
        values["vocab_size"] = len(parsed.metadata["tokenizer.ggml.tokens"])
    return values


def build_config(parsed: GGUFFile) -> transformers.PretrainedConfig:
    values = config_dict(parsed)
    return transformers.AutoConfig.for_model(**values)


def build_tokenizer(parsed: GGUFFile) -> transformers.PreTrainedTokenizerBase:
    """The fast tokenizer (chat template included) that transformers builds from the file."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    tokenizer_dict = _grouped(parsed, GGUF_TO_TRANSFORMERS_MAPPING["tokenizer"])
    init = _grouped(parsed, GGUF_TO_TRANSFORMERS_MAPPING["tokenizer_config"])
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # Older files have no flag; llama.cpp adds BOS to a sentencepiece vocabulary then.
        init.setdefault("add_bos_token", True)
    tokens = tokenizer_dict.get("tokens", [])
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = parsed.metadata.get(f"tokenizer.ggml.{key}")
        init[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(parsed.architecture, tokenizer_dict)
    name = _TOKENIZER_CLASSES.get(parsed.architecture, "PreTrainedTokenizerFast")
    return getattr(transformers, name)(tokenizer_object=backend, **init, **extra)
