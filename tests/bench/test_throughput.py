"""`sparsevllm bench throughput` on CPU: the report, and a context sweep with one engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsevllm.bench import sweep
from sparsevllm.cli import main


def test_report_counts_the_run(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "40"]
    args += ["--output-len", "6", "--batch-size", "3", "--dtype", "float32"]
    assert main(args + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["prompt_len"], r["output_len"], r["batch_size"]) == (40, 6, 3)
    assert r["concurrency"] == 3 and r["num_preemptions"] == 0
    # Phase 2 restores every prompt from the prefix cache and decodes the batch together.
    assert r["decode_phase_cached_tokens"] >= 3 * 40
    assert r["decode_steps_timed"] >= 3 and r["decode_tokens_per_s"] > 0
    assert r["peak_kv_slots"] >= 3 * 40 and 0 < r["roofline_step_s"]


def test_kvzip_reports_its_reconstruction_cost(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "64"]
    args += ["--output-len", "4", "--batch-size", "2", "--dtype", "float32"]
    args += ["--sparse-method", "kvzip", "--decode-keep-tokens", "48", "--kvzip-chunk-size", "16"]
    assert main(args + ["--json", str(out)]) == 0
    cost = json.loads(out.read_text())["scoring_pass"]
    # Two prompts of 64 tokens, four chunks each, every chunk behind its instruction.
    assert (cost["scoring_passes"], cost["scoring_forwards"]) == (2, 8)
    assert cost["tokens_per_prompt_token"] > 1 and cost["time_over_plain_prefill"] > 0


def test_sweep_reuses_one_engine_and_plots(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    args = ["bench", "throughput", "--model", tiny_llama, "--sweep-prompt-lens", "96,32,64"]
    args += ["--output-len", "5", "--batch-size", "2", "--sparse-method", "snapkv"]
    args += ["--decode-keep-tokens", "48", "--dtype", "float32", "--json", str(out)]
    assert main(args) == 0
    reports = json.loads(out.read_text())
    assert [r["prompt_len"] for r in reports] == [32, 64, 96]
    # Counters are per point: phase 2 of each point continues exactly its own 2 chains.
    assert all(r["concurrency"] == 2 for r in reports)
    assert [r["decode_phase_cached_tokens"] for r in reports] == [64, 128, 192]
    png = tmp_path / "s.png"
    assert sweep.main([str(out), "--plot", str(png), "--json", str(tmp_path / "rows.json")]) == 0
    assert png.stat().st_size > 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [row["prompt_len"] for row in rows] == [32, 64, 96]


def test_sweep_rejects_bad_lengths(tiny_llama: str) -> None:
    with pytest.raises(SystemExit, match="not a list of integers"):
        main(["bench", "throughput", "--model", tiny_llama, "--sweep-prompt-lens", "4k"])


def test_compare_hf_reports_ratios(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "40"]
    args += ["--output-len", "4", "--batch-size", "2", "--dtype", "float32", "--compare", "hf"]
    assert main(args + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["hf"]["prefill_tokens_per_s"] > 0 and r["hf"]["end_to_end_tokens_per_s"] > 0
    ratio = r["prefill_tokens_per_s"] / r["hf"]["prefill_tokens_per_s"]
    assert r["prefill_ratio_vs_hf"] == pytest.approx(ratio)
    assert r["speedup_vs_hf_end_to_end"] > 0


def test_compare_hf_out_of_memory_names_the_flag(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import GenerationMixin

    def no_room(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB.")

    monkeypatch.setattr(GenerationMixin, "generate", no_room)
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "40"]
    args += ["--output-len", "4", "--batch-size", "2", "--dtype", "float32", "--compare", "hf"]
    with pytest.raises(SystemExit, match=r"out of device memory at batch 2 x 40 .*--hf-batch-size"):
        main(args)


def test_async_scheduling_flag_reaches_the_engine(tiny_llama: str, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "40"]
    args += ["--output-len", "8", "--batch-size", "3", "--dtype", "float32"]
    assert main(args + ["--async-scheduling", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["async_scheduling"] is True and r["cuda_graphs"] is False
    assert r["decode_steps_timed"] >= 3 and r["decode_tokens_per_s"] > 0


def test_overlapped_steps_are_not_serialised(tiny_llama, tmp_path, monkeypatch) -> None:
    """With async_scheduling a step returns while the next one runs: the benchmark must
    not synchronise the device between steps (that would time host + device in series)."""
    from sparsevllm.bench import throughput

    syncs = {True: 0, False: 0}
    real = throughput._sync
    flag = {"async": False}

    def counting(device):
        syncs[flag["async"]] += 1
        real(device)

    monkeypatch.setattr(throughput, "_sync", counting)
    args = ["bench", "throughput", "--model", tiny_llama, "--prompt-len", "40"]
    args += ["--output-len", "8", "--batch-size", "3", "--dtype", "float32"]
    for overlapped in (False, True):
        flag["async"] = overlapped
        extra = ["--async-scheduling"] if overlapped else []
        assert main(args + extra + ["--json", str(tmp_path / f"{overlapped}.json")]) == 0
    # Phase 2 decodes 7 tokens: a sync per step (plus two per phase) without overlap,
    # only the two per phase with it.
    assert syncs[False] >= 4 + 7 and syncs[True] == 4


def test_moe_roofline_counts_the_routed_experts(tiny_model_factory, tmp_path: Path) -> None:
    """Qwen3-MoE (3 MoE layers of 8 experts, 2 per token, H 64, I 32): a batch-2 decode
    step reads 8 * (1 - (6/8)^2) = 3.5 experts per layer on average, not all 8; and
    transformers' generate runs on the same (stacked-expert) weights."""
    out = tmp_path / "moe.json"
    args = ["bench", "throughput", "--model", tiny_model_factory("qwen3_moe")]
    args += ["--prompt-len", "24", "--output-len", "4", "--batch-size", "2"]
    args += ["--dtype", "float32", "--compare", "hf", "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    moe = r["moe"]
    assert (moe["moe_layers"], moe["experts"], moe["experts_per_token"]) == (3, 8, 2)
    assert moe["active_experts_per_layer"] == pytest.approx(3.5)
    expert_bytes = 3 * 8 * 3 * 64 * 32 * 4  # layers x experts x (gate, up, down) x H x I x fp32
    skipped = moe["weight_bytes_all_experts"] - r["weight_bytes_per_step"]
    assert skipped == pytest.approx(expert_bytes * (1 - 3.5 / 8), abs=1)
    assert r["hf"]["end_to_end_tokens_per_s"] > 0


def test_qwen3_moe_preset_runs_with_dummy_weights(monkeypatch, tmp_path: Path) -> None:
    """`--model-config qwen3-30b-a3b`, its sizes shrunk (the keys and the family kept):
    the preset builds the MoE model, draws dummy weights and decodes."""
    import sparsevllm.bench.model_configs as model_configs

    tiny = dict(model_configs.MODEL_CONFIGS["qwen3-30b-a3b"])
    tiny.update(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2)
    tiny.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tiny.update(vocab_size=512)
    monkeypatch.setitem(model_configs.MODEL_CONFIGS, "qwen3-30b-a3b", tiny)
    out = tmp_path / "preset.json"
    args = ["bench", "throughput", "--model-config", "qwen3-30b-a3b", "--prompt-len", "16"]
    args += ["--output-len", "4", "--batch-size", "64", "--dtype", "float32", "--json", str(out)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "qwen3-30b-a3b" and r["decode_tokens_per_s"] > 0
    assert r["moe"]["moe_layers"] == 2 and r["moe"]["experts_per_token"] == 8
    assert r["moe"]["experts"] == 128  # 64 tokens x 8 of 128 experts: nearly all of them
    assert 125 < r["moe"]["active_experts_per_layer"] < 126
