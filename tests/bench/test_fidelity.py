"""`sparsevllm bench fidelity`: its measures, a tiny end-to-end run, and its --help."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsevllm.bench import fidelity
from sparsevllm.bench.quality.words import essay_sentence
from sparsevllm.cli import build_parser, main

SRC = str(Path(__file__).resolve().parents[2] / "src")
TINY_ARGS = ["--num-prompts", "2", "--prompt-tokens", "64", "--new-tokens", "8"]
TINY_ARGS += ["--kl-tokens", "128", "--no-progress"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-m", "sparsevllm.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def essay_llama(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random Llama with a lower-case word-level tokenizer of the essay grammar's
    words: the conftest tokenizer maps them to <unk>, which would make every position's
    token (and every prompt) the same."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import CHAT_TEMPLATE

    rng = random.Random(0)
    text = " ".join(essay_sentence(rng) for _ in range(5000))
    text += f" {fidelity.HEADER} {fidelity.QUESTION} Answer:"
    words = ["<unk>", "<s>", "</s>", "user", "assistant", ":"]
    words += sorted(set(re.findall(r"\w+|[^\w\s]+", text.lower())))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    assert len(vocab) <= 256  # the tiny model's vocabulary
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("essay_llama")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    fast.save_pretrained(path)
    return str(path)


def test_common_prefix() -> None:
    assert fidelity.common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert fidelity.common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert fidelity.common_prefix([4], [5]) == 0
    assert fidelity.common_prefix([1, 2], [1, 2, 3]) == 2


def test_kl_stats_against_a_direct_computation() -> None:
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(300, 50) * 3, torch.randn(300, 50) * 3
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    expected = (p * (p / q).log()).sum(-1)
    got = fidelity.kl_stats(p_logits, q_logits, rows=7)  # rows do not divide 300
    assert got["mean_kl"] == pytest.approx(float(expected.mean()), rel=1e-9)
    assert got["max_kl"] == pytest.approx(float(expected.max()), rel=1e-9)
    same = (p.argmax(-1) == q.argmax(-1)).double().mean()
    assert got["argmax_agreement"] == pytest.approx(float(same))
    zero = fidelity.kl_stats(p_logits, p_logits.clone())
    assert zero == {"mean_kl": 0.0, "max_kl": 0.0, "argmax_agreement": 1.0}
    with pytest.raises(ValueError, match="shapes differ"):
        fidelity.kl_stats(p_logits, q_logits[:-1])


def test_prompts_have_their_length_and_differ(essay_llama: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(essay_llama)
    prompts = fidelity.agreement_prompts(tok, 3, 400, seed=0, chat=True)
    assert all(abs(len(p) - 400) <= 8 for p in prompts), [len(p) for p in prompts]
    assert len({tuple(p) for p in prompts}) == 3
    assert prompts == fidelity.agreement_prompts(tok, 3, 400, seed=0, chat=True)
    assert prompts != fidelity.agreement_prompts(tok, 3, 400, seed=1, chat=True)
    assert tok.unk_token_id not in prompts[0]
    text = tok.decode(prompts[0])
    assert "assistant :" in text and "answer in a few sentences ." in text
    plain = tok.decode(fidelity.agreement_prompts(tok, 1, 400, seed=0, chat=False)[0])
    assert plain.endswith("answer :") and "assistant" not in plain
    assert len(fidelity.kl_ids(tok, 500, seed=0)) == 500


def test_small_run(essay_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, png = tmp_path / "f.json", tmp_path / "f.png"
    formats = "auto,int8,fp8_e4m3"
    argv = ["bench", "fidelity", "--model", essay_llama, "--formats", formats, *TINY_ARGS]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert {"model", "dtype", "device", "reference", "formats", "settings", "versions"} <= set(
        report
    )
    assert (report["dtype"], report["device"]) == ("float32", "cpu")
    assert report["engine"]["enable_prefix_caching"] is False
    s = report["settings"]
    assert (s["num_prompts"], s["new_tokens"], s["kl_positions"], s["chat"]) == (2, 8, 128, True)
    assert (s["kl_chunk"], s["kl_prefill_chunks"]) == (16, 8)
    assert list(report["formats"]) == formats.split(",")
    keys = {"identical_first_n", "mean_common_prefix", "mean_kl", "max_kl", "kv_bytes_per_slot"}
    for r in report["formats"].values():
        assert keys <= set(r)
        assert 0 <= r["identical_first_n"] <= 2
        assert 0 <= r["mean_common_prefix"] <= 8 and len(r["common_prefix"]) == 2
        assert math.isfinite(r["mean_kl"]) and 0 <= r["mean_kl"] <= r["max_kl"]
        assert math.isfinite(r["max_kl"])
    again = report["formats"]["auto"]  # a second auto engine reproduces the reference
    assert (again["identical_first_n"], again["mean_common_prefix"]) == (2, 8)
    assert again["mean_kl"] == again["max_kl"] == 0.0
    assert again["kv_bytes_per_slot"] == report["reference"]["kv_bytes_per_slot"]
    for fmt in ("int8", "fp8_e4m3"):
        r = report["formats"][fmt]
        # Quantized KV changes the logits of every chunk after the first (older chunks
        # are read from storage), differently at different positions.
        assert 0 < r["mean_kl"] < r["max_kl"], fmt
        assert r["kv_bytes_per_slot"] < report["reference"]["kv_bytes_per_slot"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| int8 |" in printed and "identical first 8 (of 2)" in printed


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "fidelity", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "fidelity", "--formats", "int9"])
    assert exc.value.code == 2
    assert "did you mean 'int8'" in capsys.readouterr().err


def test_help_documents_every_flag() -> None:
    out = cli("bench", "fidelity", "--help")
    assert out.returncode == 0, out.stderr
    parser = build_parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    sub = bench._subparsers._group_actions[0].choices["fidelity"]
    flags = [f for a in sub._actions for f in a.option_strings if f.startswith("--")]
    assert len(flags) > 15
    for action in sub._actions:
        assert action.help, action.option_strings
    for flag in flags:
        assert flag in out.stdout, flag
    for flag in ("--model", "--formats", "--dtype", "--num-prompts", "--prompt-tokens"):
        assert flag in flags
    for flag in ("--new-tokens", "--kl-tokens", "--seed", "--json", "--plot", "--config"):
        assert flag in flags
    words = " ".join(out.stdout.split())  # argparse wraps lines anywhere
    assert "gemma3-270m" in words and "(default: float32)" in words


def test_bench_help_lists_fidelity() -> None:
    out = cli("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "fidelity" in out.stdout and "KL" in out.stdout
