"""`sparsevllm deltakv train` and `eval` on a tiny model's capture: training lowers the
validation loss, a stopped run resumes exactly, eval reports every field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparsevllm.cli import main
from sparsevllm.deltakv.checkpoint import load_compressor
from sparsevllm.deltakv_tools.capture_set import open_capture
from sparsevllm.deltakv_tools.dataset import split_refs


def _run(capsys, *argv: str) -> dict:
    code = main(["deltakv", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out) if out.out.lstrip().startswith("{") else {"text": out.out}


@pytest.fixture(scope="module")
def capture(tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    words = " ".join(f"w{7 + (i * i + 3 * i) % 240}" for i in range(1400))
    (root / "doc.txt").write_text(words)
    out = root / "cap"
    code = main(
        ["deltakv", "collect", "--model", tiny_model_factory("llama"), "--out", str(out),
         "--files", str(root / "doc.txt"), "--max-tokens", "128", "--min-tokens", "64",
         "--queries", "16", "--no-progress"]
    )  # fmt: skip
    assert code == 0
    return out


def _train(capsys, data, out, *extra: str) -> dict:
    return _run(
        capsys, "train", "--data", str(data), "--out", str(out), "--latent-dim", "8",
        "--val-fraction", "0.25", "--log-every", "2", "--eval-every", "4", "--save-every", "4",
        "--no-progress", "--threads", "1", *extra,
    )  # fmt: skip


def test_training_lowers_the_validation_loss(capture, tmp_path, capsys):
    summary = _train(capsys, capture, tmp_path, "--init", "random", "--steps", "40", "--lr", "1e-2")
    assert summary["finished"] and summary["step"] == 40
    assert summary["validation"]["loss"] < 0.7 * summary["first_validation"]["loss"]
    for name in ("compressor.safetensors", "train_state.pt", "log.json", "loss.png"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["finished"] and log["train_sequences"] >= 6 and log["val_sequences"] >= 1
    assert [e["step"] for e in log["validation"]] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert len(log["history"]) == 20 and {"loss", "k", "v", "attn", "lr"} <= set(log["history"][0])
    assert log["command"].startswith("sparsevllm deltakv train --data")


def test_pca_start_is_already_better_than_random(capture, tmp_path, capsys):
    pca = _train(capsys, capture, tmp_path / "pca", "--steps", "1")
    rnd = _train(capsys, capture, tmp_path / "rnd", "--steps", "1", "--init", "random")
    assert pca["first_validation"]["loss"] < 0.5 * rnd["first_validation"]["loss"]


def test_a_stopped_run_resumes_exactly(capture, tmp_path, capsys):
    _train(capsys, capture, tmp_path / "a", "--steps", "10")
    part = _train(capsys, capture, tmp_path / "b", "--steps", "10", "--stop-after", "6")
    assert part["step"] == 6 and not part["finished"] and part["stopped"] == "stop_after"
    done = _train(capsys, capture, tmp_path / "b", "--steps", "10", "--resume")
    assert done["finished"] and done["step"] == 10
    a = load_file(str(tmp_path / "a" / "compressor.safetensors"))
    b = load_file(str(tmp_path / "b" / "compressor.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log_a = json.loads((tmp_path / "a" / "log.json").read_text())
    log_b = json.loads((tmp_path / "b" / "log.json").read_text())
    assert log_a["validation"] == log_b["validation"] and log_a["history"] == log_b["history"]


def test_resume_refuses_other_settings(capture, tmp_path, capsys):
    _train(capsys, capture, tmp_path, "--steps", "4", "--stop-after", "2")
    code = main(
        ["deltakv", "train", "--data", str(capture), "--out", str(tmp_path), "--latent-dim", "8",
         "--val-fraction", "0.25", "--steps", "4", "--lr", "0.5", "--resume", "--no-progress"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "lr: 0.001 -> 0.5" in err and "Traceback" not in err


def test_eval_reports_every_layer_and_variant(capture, tmp_path, capsys):
    _train(capsys, capture, tmp_path, "--steps", "8", "--save-dtype", "float16")
    ckpt = tmp_path / "compressor.safetensors"
    _, info = load_compressor(ckpt)
    assert info.training["steps"] == 8 and info.training["val_fraction"] == 0.25
    printed = _run(
        capsys, "eval", str(ckpt), "--data", str(capture), "--json", str(tmp_path / "e.json")
    )
    report = json.loads((tmp_path / "e.json").read_text())
    val = split_refs(open_capture(capture).sequences, 0.25)[1]
    assert report["split"] == "val" and report["sequences"] == len(val)
    assert [r["layer"] for r in report["per_layer"]] == [0, 1]
    fields = {f"{v}_{e}" for v in ("latent", "int4", "references") for e in ("k", "v", "attn")}
    for row in report["per_layer"]:
        assert fields <= set(row) and row["latent_dim"] == 8
        assert row["latent_k"] < row["references_k"] and row["latent_v"] < row["references_v"]
        assert row["latent_k"] <= row["int4_k"] * 1.05  # INT4 costs a little
    assert fields <= set(report["mean"])
    assert "latent_attn" in printed["text"] and "mean" in printed["text"]
    everything = _run(capsys, "eval", str(ckpt), "--data", str(capture), "--split", "all")
    assert "split" not in everything  # the table, not JSON


def test_a_full_width_pca_start_reconstructs_exactly(capture, tmp_path, capsys):
    """At r = kv_dim the weighted PCA spans every residual: K, V and the attention output
    come back exactly (float32 rounding), which checks the closed form."""
    full = _run(capsys, "train", "--data", str(capture), "--out", str(tmp_path), "--latent-dim",
                "64", "--steps", "1", "--lr", "1e-12", "--no-progress")  # fmt: skip
    first = full["first_validation"]
    assert first["k"] < 1e-9 and first["v"] < 1e-9 and first["attn"] < 1e-8
