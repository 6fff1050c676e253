"""`sparsevllm deltakv collect` on tiny models: shards within the cap with the right
shapes, every source, and captured tensors equal to what transformers computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsevllm.cli import main
from sparsevllm.deltakv.rope import unrotate
from sparsevllm.deltakv_tools.capture_set import open_capture
from sparsevllm.sparse.registry import method_names
from tiny_gemma3 import save_tiny_gemma3

QUERIES = 8


def _collect(model: str, out, capsys, *extra: str) -> dict:
    code = main(
        ["deltakv", "collect", "--model", model, "--out", str(out), "--max-tokens", "160",
         "--min-tokens", "16", "--queries", str(QUERIES), "--no-progress", *extra]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    (root / "prompts.txt").write_text("w10 w11 w12 w13\nw40 w41 w42 w43 w44 w45\n")
    words = " ".join(f"w{7 + (i * 37) % 240}" for i in range(500))
    (root / "doc.txt").write_text(words)
    return root


@pytest.fixture(scope="module")
def capture(tiny_model_factory, texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture")
    model = tiny_model_factory("llama")
    code = main(
        ["deltakv", "collect", "--model", model, "--out", str(out), "--max-tokens", "160",
         "--min-tokens", "16", "--queries", str(QUERIES), "--no-progress", "--dtype", "float32",
         "--prompts", str(texts / "prompts.txt"), "--max-new-tokens", "24",
         "--files", str(texts / "doc.txt"), "--haystacks", "niah_single",
         "--haystack-length", "120", "--haystack-samples", "2", "--shard-mb", "0.2",
         "--max-gb", "0.01"]
    )  # fmt: skip
    assert code == 0
    return model, out


def test_every_source_is_captured_with_the_right_shapes(capture):
    _, out = capture
    cap = open_capture(out)
    lay = cap.layout
    assert lay.layers == (0, 1) and (lay.num_heads, lay.num_kv_heads, lay.head_dim) == (4, 2, 16)
    assert lay.scales == {0: 16**-0.5, 1: 16**-0.5}
    sources = [r.source for r in cap.sequences]
    assert sources.count("prompts") == 2 and sources.count("haystack") == 2
    assert sources.count("files") == 4  # 500 words -> windows of 159 + BOS; the tail of 23 too
    for seq in cap.load():
        t, q = seq.ref.length, min(QUERIES, seq.ref.length)
        assert seq.tokens.shape == (t,) and 16 <= t <= 160
        assert seq.query_positions.tolist() == list(range(t - q, t))
        for layer in lay.layers:
            assert seq.keys[layer].shape == seq.values[layer].shape == (t, 2, 16)
            assert seq.queries[layer].shape == (q, 4, 16)
            assert seq.keys[layer].dtype == torch.float32
            assert seq.rope[layer] is not None and seq.rope[layer].shape == (8,)
    prompt = next(s for s in cap.load() if s.ref.source == "prompts")
    assert prompt.ref.length == 4 + 24  # the prompt's words + the model's 24 tokens


def test_the_shards_stay_within_the_cap(capture):
    _, out = capture
    manifest = json.loads((out / "manifest.json").read_text())
    files = sorted(out.glob("shard-*.safetensors"))
    assert len(files) == len(manifest["shards"]) >= 2  # --shard-mb 0.2 cuts several
    assert sum(f.stat().st_size for f in files) == manifest["bytes"] <= 0.01 * 2**30
    assert manifest["num_sequences"] == 8 and not manifest["stopped_at_cap"]
    assert manifest["command"].startswith("sparsevllm deltakv collect --model")
    assert "deltakv_capture" not in method_names()  # registered for collect's engine only


def test_the_cap_stops_collection_before_passing_it(tiny_model_factory, texts, tmp_path, capsys):
    cap = 0.0002  # GiB: about 210 KB, room for two of the 160-token windows (82 KB each)
    summary = _collect(
        tiny_model_factory("llama"), tmp_path, capsys, "--files", str(texts / "doc.txt"),
        "--max-gb", str(cap), "--dtype", "float32",
    )  # fmt: skip
    assert summary["stopped_at_cap"] and 1 <= summary["num_sequences"] < 4
    total = sum(f.stat().st_size for f in tmp_path.glob("shard-*.safetensors"))
    assert total == summary["bytes"] <= cap * 2**30


def _hf_projections(path: str, ids: list[int], q_name: str, k_name: str) -> dict:
    """Per layer, the pre-RoPE q, k (after q/k norms where the model has them) and v of
    transformers' forward, from hooks on the named submodules of each attention."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got: dict = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        attn = layer.self_attn
        for tag, mod in (("q", getattr(attn, q_name)), ("k", getattr(attn, k_name))):
            hooks.append(
                mod.register_forward_hook(lambda m, a, o, i=i, t=tag: got.update({(i, t): o}))
            )
        hooks.append(
            attn.v_proj.register_forward_hook(lambda m, a, o, i=i: got.update({(i, "v"): o}))
        )
    with torch.no_grad():
        hf(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return got


def _heads(out: torch.Tensor, t: int, d: int) -> torch.Tensor:
    """A projection's output as `[T, H, D]`: `[1, T, H * D]`, or `[1, H, T, D]` after a
    q/k norm (transformers transposes before it)."""
    return out[0].transpose(0, 1) if out.dim() == 4 else out[0].reshape(t, -1, d)


def _compare(cap_dir, path: str, q_name: str, k_name: str) -> None:
    cap = open_capture(cap_dir)
    lay = cap.layout
    for seq in cap.load()[:3]:
        ids = seq.tokens.tolist()
        hf = _hf_projections(path, ids, q_name, k_name)
        t, d = len(ids), lay.head_dim
        for layer in lay.layers:
            k = _heads(hf[(layer, "k")], t, d)
            v = _heads(hf[(layer, "v")], t, d)
            q = _heads(hf[(layer, "q")], t, d)[seq.query_positions]
            assert torch.allclose(seq.keys[layer], k, atol=2e-5), layer
            assert torch.allclose(seq.values[layer], v, atol=2e-5), layer
            pre_q = unrotate(seq.queries[layer], seq.query_positions, seq.rope[layer])
            assert torch.allclose(pre_q, q, atol=2e-5), layer


def test_captured_keys_values_and_queries_equal_transformers(capture):
    """Keys before RoPE, values, and queries (post-RoPE; turned back here) of the engine
    equal transformers' projections (Llama 3 RoPE scaling: frequencies matter)."""
    model, out = capture
    _compare(out, model, "q_proj", "k_proj")


def test_gemma3_captures_its_full_layers_after_qk_norm(tiny_model_factory, tmp_path, capsys):
    """Sliding-window layers are not managed, so not captured; keys are taken after
    k_norm (what the pool stores, before RoPE) with the model's own attention scale."""
    path = save_tiny_gemma3(tmp_path / "gemma")
    llama = tiny_model_factory("llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src := __import__("pathlib").Path(llama) / name).exists():
            shutil.copy(src, tmp_path / "gemma" / name)
    (tmp_path / "doc.txt").write_text(" ".join(f"w{10 + i % 200}" for i in range(150)))
    out = tmp_path / "cap"
    _collect(path, out, capsys, "--files", str(tmp_path / "doc.txt"), "--dtype", "float32")
    lay = open_capture(out).layout
    assert lay.layers == (1, 3) and lay.scales == {1: 24**-0.5, 3: 24**-0.5}
    _compare(out, path, "q_norm", "k_norm")
