"""The query-agnostic mode: two-turn prompts, chain continuation, both modes in one report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparsevllm.bench.quality import generate
from sparsevllm.bench.quality.calibrate import build_calibration
from sparsevllm.bench.quality.grid import make_grid
from sparsevllm.bench.quality.report import markdown_table, plot
from sparsevllm.bench.quality.reports import load_report
from sparsevllm.bench.quality.runner import (
    ANSWER_SEP,
    RunSettings,
    load_tokenizer,
    prompt_ids,
    run_quality,
)
from sparsevllm.bench.quality.turns import ACK, split_prompt, turn_ids

LENGTH = 256
MODES = ["query_aware", "query_agnostic"]
ENGINE = {"max_num_seqs": 2, "chunk_prefill_size": 64}


def run(model: str, out: Path, modes: list[str], methods: list[str] | None = None) -> dict:
    grid = make_grid(
        ["niah_single", "niah_multikey"],
        [LENGTH],
        3,
        methods or ["vanilla", "snapkv", "quest"],
        [0.5],
        modes=modes,
    )
    settings = RunSettings(model, ENGINE, max_tokens=4, progress=False)
    return run_quality(grid, settings, out / "q.json")


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "q.jsonl").read_text().splitlines()]


def test_turns_cut_the_prompt_before_the_question(tiny_llama: str) -> None:
    tok = load_tokenizer(RunSettings(tiny_llama))
    sample = generate("niah_multikey", tok, 128, 0, 0.5)
    context, question = split_prompt(sample)
    assert context + question == sample.prompt and question == "\n\n" + sample.question
    assert all(n.value in context for n in sample.needles)
    plain = turn_ids(sample, tok, chat=False)
    assert plain.first == tok.encode(context)
    assert plain.second[: len(plain.first)] == plain.first
    rest = sample.question + ANSWER_SEP + sample.answer_prefix
    assert plain.second[len(plain.first) :] == tok.encode("\n\n" + rest, add_special_tokens=False)
    # Within a few tokens of the query-aware prompt: the same text cut in two pieces.
    assert abs(len(plain.second) - len(prompt_ids(sample, tok, chat=False))) <= 2

    chat = turn_ids(sample, tok, chat=True)
    assert chat.second[: len(chat.first)] == chat.first
    # The tiny template: "<s> user : {context} </s> <s> assistant : ", then the reply to
    # it, the question as the next user message, and the answer prefix.
    assert tok.decode(chat.first[-4:]) == "</s> <s> assistant :"
    tail = chat.second[len(chat.first) :]
    ack, asked = (tok.encode(t, add_special_tokens=False) for t in (ACK, sample.question))
    prefix = tok.encode(sample.answer_prefix, add_special_tokens=False)
    assert tail[: len(ack)] == ack and tail[-len(prefix) :] == prefix
    assert tok.decode(tail[len(ack) : len(ack) + 4]) == "</s> <s> user :"
    assert tail[len(ack) + 4 : len(ack) + 4 + len(asked)] == asked


def test_second_turn_continues_the_compressed_chain(tiny_llama: str, tmp_path: Path) -> None:
    report = run(tiny_llama, tmp_path, ["query_agnostic"])
    recs = records(tmp_path)
    assert len(recs) == 2 * 3 * 3 and {r["mode"] for r in recs} == {"query_agnostic"}
    for r in recs:
        # Turn 2 extends turn 1's cached state. (The radix cache may lend more: the toy
        # tokenizer reads most words as <unk>, so the samples share long prefixes.)
        assert r["context_tokens"] <= r["cached_tokens"] < r["num_tokens"]
    for r in (r for r in recs if r["method"] == "snapkv"):
        # The chain's state is turn 1's prompt; only the question is prefilled.
        assert r["chain_status"] == "continued" and r["cached_tokens"] == r["context_tokens"]
        # SnapKV compressed turn 1 at the end of its prefill, before the question came:
        # the idle chain held the budget, not the context.
        assert r["context_kv_slots"] <= r["budget"] == LENGTH // 2 < r["context_tokens"]
    for r in (r for r in recs if r["method"] != "snapkv"):  # radix: the whole prefix lent
        assert r["chain_status"] is None and r["context_kv_slots"] is None
    engines = report["metadata"]["engines_run"]
    assert all(e["mode"] == "query_agnostic" for e in engines) and len(engines) == 3
    assert report["metadata"]["two_turns"]["engine"] == {"enable_prefix_caching": True}
    assert report["metadata"]["engine"]["enable_prefix_caching"] is False  # query-aware's


def test_both_modes_in_one_report_and_resume(tiny_llama: str, tmp_path: Path) -> None:
    run(tiny_llama, tmp_path, ["query_aware"])
    aware = records(tmp_path)
    assert {r["mode"] for r in aware} == {"query_aware"}
    both = run(tiny_llama, tmp_path, MODES)  # resumes: only the query-agnostic cells run
    assert {e["mode"] for e in both["metadata"]["engines_run"]} == {"query_agnostic"}
    assert len(records(tmp_path)) == 2 * len(aware)
    assert {(r["mode"], r["method"]) for r in both["results"]} == {
        (mode, method) for mode in MODES for method in ("vanilla", "snapkv", "quest")
    }
    assert {(s["mode"], s["method"]) for s in both["summary"]} == {
        (mode, method) for mode in MODES for method in ("vanilla", "snapkv", "quest")
    }
    again = run(tiny_llama, tmp_path, MODES)
    assert again["metadata"]["engines_run"] == [] and again["results"] == both["results"]
    table = markdown_table(both)
    assert table.index("query_aware:") < table.index("query_agnostic:")
    assert table.count("| snapkv | 0.5 |") == 2
    plot(both, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"

    # A calibration reads only the query-aware rows. The tiny model scores 0 everywhere,
    # so give the rows accuracies: query-agnostic ones that would change every point.
    for row in both["results"]:
        aware = row["mode"] == "query_aware"
        row["accuracy"] = (1.0 if row["method"] == "vanilla" else 0.5) if aware else 0.1
    mixed, aware_only = tmp_path / "mixed.json", tmp_path / "aware.json"
    mixed.write_text(json.dumps(both))
    kept = [r for r in both["results"] if r["mode"] == "query_aware"]
    aware_only.write_text(json.dumps({**both, "results": kept}))
    assert load_report(str(mixed)).rows == load_report(str(aware_only)).rows
    cal = build_calibration([load_report(str(mixed))], "test")
    assert {p.relative_accuracy for c in cal.methods.values() for p in c.points} == {0.5}


def test_old_records_without_a_mode_are_query_aware(tiny_llama: str, tmp_path: Path) -> None:
    run(tiny_llama, tmp_path, ["query_aware"], ["vanilla"])
    lines = records(tmp_path)
    for r in lines:
        del r["mode"]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    again = run(tiny_llama, tmp_path, ["query_aware"], ["vanilla"])
    assert again["metadata"]["engines_run"] == []
    assert all(r["num_samples"] == 3 for r in again["results"])


def test_unknown_mode_names_the_closest() -> None:
    with pytest.raises(ValueError, match="unknown mode 'query_agnostik'; did you mean"):
        make_grid(modes=["query_agnostik"])
