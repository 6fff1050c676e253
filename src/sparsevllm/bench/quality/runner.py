"""Run the quality grid (`sparsevllm bench quality`): samples, engines, records, resuming.

Every (method, ratio, length) cell of the grid (see `grid`) builds one engine and sends all
of its samples in one batched `generate` call; the engine batches them continuously. The
prompt is `sample.prompt + ANSWER_SEP + sample.answer_prefix`, a plain completion (with
`chat`: the prompt as a user message through the chat template, then the prefix). Decoding
is greedy and `max_tokens` is sized to the answers. A query-agnostic cell sends each sample
as two turns of one conversation instead, the context first and the question second
(`turns`).

Every output becomes one JSON line in the records file, written as soon as its cell ends.
A run skips the (method, ratio, task, length, seed, mode) records the file already holds, after
checking that each one's prompt hash matches the sample this run builds (and that model
and prompt format are the same); a cell with nothing left to do builds no engine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from sparsevllm.bench.quality import Sample, generate, prompt_hash, score
from sparsevllm.bench.quality.grid import (
    QUERY_AGNOSTIC,
    QUERY_AWARE,
    Cell,
    Grid,
    Key,
    describe,
    make_key,
)
from sparsevllm.bench.quality.report import build_report
from sparsevllm.bench.quality.settings import ANSWER_SEP, RunSettings
from sparsevllm.bench.quality.turns import (
    Turns,
    TwoTurnOutput,
    check_continued,
    run_two_turns,
    turn_ids,
)
from sparsevllm.calibration import model_identity
from sparsevllm.config import EngineConfig
from sparsevllm.llm import LLM
from sparsevllm.sampling import SamplingParams

# Fewest output tokens per task; more when the answers are long (see `max_tokens_for`).
MAX_TOKENS_FLOOR = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "variable_tracking": 48,
    "common_words_extraction": 128,
    "frequent_words_extraction": 64,
}
# What every stored record holds; `mode` may be missing (records from before modes).
RECORD_FIELDS = ("method", "ratio", "task", "length", "seed", "prompt_hash", "score")


@dataclass
class Item:
    """A sample prepared for the engine."""

    sample: Sample
    length: int  # the grid's target length
    ids: list[int]  # the prompt's token ids, as fed to the engine
    max_tokens: int
    turns: Turns | None = None  # the query-agnostic turns, when the grid has that mode

    def prompt(self, mode: str) -> list[int]:
        """The token ids the model completes in `mode` (turn 2's in query-agnostic)."""
        if mode != QUERY_AGNOSTIC:
            return self.ids
        if self.turns is None:
            raise ValueError("this item was built without its query-agnostic turns")
        return self.turns.second


# ------------------------------------------------------------------------ samples


def max_tokens_for(sample: Sample, tokenizer: Any) -> int:
    """Output tokens for a sample: the task's floor, or twice the answers' tokens + 16."""
    answer_tokens = len(tokenizer.encode(", ".join(sample.answers), add_special_tokens=False))
    return max(MAX_TOKENS_FLOOR.get(sample.task, 64), 2 * answer_tokens + 16)


def prompt_ids(sample: Sample, tokenizer: Any, chat: bool) -> list[int]:
    """Token ids of the prompt the model completes: the question, then the answer prefix."""
    if not chat:
        return list(tokenizer.encode(sample.prompt + ANSWER_SEP + sample.answer_prefix))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat prompts need a tokenizer with a chat template")
    messages = [{"role": "user", "content": sample.prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text + sample.answer_prefix, add_special_tokens=False))


def build_items(grid: Grid, tokenizer: Any, settings: RunSettings) -> dict[tuple, Item]:
    """Every sample of the grid by (task, length, seed); all methods share them."""
    items: dict[tuple, Item] = {}
    agnostic = QUERY_AGNOSTIC in grid.modes
    for task in grid.tasks:
        for length in grid.lengths:
            for seed, depth in zip(grid.seeds(), grid.depths(task)):
                sample = generate(task, tokenizer, length, seed, depth)
                max_tokens = settings.max_tokens or max_tokens_for(sample, tokenizer)
                ids = prompt_ids(sample, tokenizer, settings.chat)
                turns = turn_ids(sample, tokenizer, settings.chat) if agnostic else None
                items[(task, length, seed)] = Item(sample, length, ids, max_tokens, turns)
    return items


def load_tokenizer(settings: RunSettings) -> Any:
    """The model's tokenizer, without building the model."""
    return _load_source(settings).tokenizer


def _load_source(settings: RunSettings) -> Any:
    """The model's config and tokenizer (models.loader.ModelSource), without weights."""
    from sparsevllm.models.loader import load_model_source

    engine = settings.engine
    source = load_model_source(
        settings.model, engine.get("tokenizer"), engine.get("load_format", "auto")
    )
    if source.tokenizer is None:
        raise ValueError(f"{settings.model}: the quality tasks need a model with a tokenizer")
    return source


def model_identity_of(source: Any) -> dict[str, Any]:
    """The names and config fingerprint a calibration made from the report matches."""
    identity = model_identity(source.path, source.hf_config.to_dict())
    return {"names": list(identity.names), "fingerprint": identity.fingerprint}


# ------------------------------------------------------------------------ records


def record_key(rec: dict[str, Any]) -> Key:
    """The key of a stored record (records without a mode are query-aware)."""
    mode = rec.get("mode", QUERY_AWARE)
    return make_key(rec["method"], rec["ratio"], rec["task"], rec["length"], rec["seed"], mode)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of earlier runs (none when the file does not exist)."""
    if not path.exists():
        return []
    records = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from e
            missing = [k for k in RECORD_FIELDS if k not in rec]
            if missing:
                raise ValueError(f"{path}:{n}: the record lacks {', '.join(missing)}")
            records.append(rec)
    return records


def reusable(
    records: list[dict[str, Any]], items: dict[tuple, Item], ident: dict[str, Any]
) -> dict[Key, dict[str, Any]]:
    """The stored records of this grid's samples, by key. A record that disagrees with the
    sample this run builds (its prompt hash, model or prompt format) is an error naming
    its cell: mixing them would silently score two different benchmarks as one."""
    done: dict[Key, dict[str, Any]] = {}
    for rec in records:
        item = items.get((rec["task"], rec["length"], rec["seed"]))
        if item is None:
            continue  # a sample of another grid: stays in the file, unused here
        key = record_key(rec)
        expected = prompt_hash(item.sample)
        if rec["prompt_hash"] != expected:
            raise ValueError(
                f"stored record ({describe(key)}) has prompt hash {rec['prompt_hash']} but "
                f"this run builds {expected}: the task changed; use a new output file"
            )
        for name, value in ident.items():
            if rec.get(name) != value:
                raise ValueError(
                    f"stored record ({describe(key)}) was made with {name}={rec.get(name)!r} "
                    f"but this run uses {value!r}; use a new output file"
                )
        done[key] = rec
    return done


def make_record(cell: Cell, item: Item, output: Any, ident: dict[str, Any]) -> dict[str, Any]:
    """One JSON line: the sample's identity, the model's output and its score."""
    s = item.sample
    value = score(s, output.text)
    return {
        "mode": cell.mode,
        "task": s.task,
        "length": item.length,
        "seed": s.seed,
        "depth": s.depth,
        "method": cell.method,
        "ratio": cell.ratio,
        "budget": cell.budget(item.length),
        "prompt_hash": prompt_hash(s),
        "num_tokens": len(item.prompt(cell.mode)),
        "output": output.text,
        "answers": list(s.answers),
        "score": value,
        "correct": value == 1.0,
        "max_tokens": item.max_tokens,
        "output_tokens": len(output.token_ids),
        "finish_reason": output.finish_reason,
        **ident,
    }


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append records and flush them to disk (a later crash keeps them)."""
    with path.open("a") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------ engines


def two_turn_fields(turns: Turns, output: TwoTurnOutput) -> dict[str, Any]:
    """What a query-agnostic record adds: the turn lengths and what the cache lent turn 2."""
    return {
        "context_tokens": len(turns.first),
        "cached_tokens": output.output.num_cached_tokens,
        "chain_status": output.output.chain_status,
        "context_kv_slots": output.context_kv_slots,
    }


def generate_cell(llm: Any, cell: Cell, items: list[Item]) -> tuple[list[Any], list[dict]]:
    """Every item's output: in one `generate` call, or as two turns each (query-agnostic);
    with the extra record fields of each."""
    params = [SamplingParams(temperature=0.0, max_tokens=it.max_tokens) for it in items]
    if cell.mode != QUERY_AGNOSTIC:
        return llm.generate([it.ids for it in items], params, use_tqdm=False), [{}] * len(items)
    turns = [it.turns for it in items if it.turns is not None]
    if len(turns) != len(items):
        raise ValueError("query-agnostic items need their turns (build_items with that mode)")
    two = run_two_turns(llm.engine, turns, params)
    check_continued(llm.engine, two)
    return [t.output for t in two], [two_turn_fields(tt, t) for tt, t in zip(turns, two)]


def run_cell(cell: Cell, items: list[Item], settings: RunSettings) -> tuple[list, dict]:
    """Build the cell's engine, generate every item, score: (records, timing)."""
    t0 = time.perf_counter()
    llm = LLM(settings.model, **settings.engine_kwargs(cell))
    load_s = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), time.process_time()
    outputs, extra = generate_cell(llm, cell, items)
    generate_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    for it, out in zip(items, outputs):
        if out.finish_reason in ("error", "abort"):
            s = it.sample
            key = make_key(cell.method, cell.ratio, s.task, it.length, s.seed, cell.mode)
            raise RuntimeError(f"{describe(key)}: generation failed: {out.error}")
    records = [
        {**make_record(cell, it, out, settings.ident), **more}
        for it, out, more in zip(items, outputs, extra)
    ]
    runner, stats = llm.engine.runner, llm.stats()
    timing = {
        "mode": cell.mode,
        "method": cell.method,
        "ratio": cell.ratio,
        "length": cell.length,
        "knobs": llm.engine.method.knob_values(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "num_samples": len(items),
        "prompt_tokens": sum(len(it.prompt(cell.mode)) for it in items),
        "output_tokens": sum(len(o.token_ids) for o in outputs),
        "load_s": load_s,
        "generate_s": generate_s,
        "generate_cpu_s": cpu_s,
        "kv_slots_peak": stats["kv_slots_peak"],
        "num_preemptions": stats["num_preemptions"],
    }
    llm.close()  # the next cell's engine needs the device memory
    return records, timing


# ------------------------------------------------------------------------ the run


def pending_items(grid: Grid, cell: Cell, items: dict[tuple, Item], done: dict) -> list[Item]:
    """The cell's samples without a record yet."""
    keys = [key for key in grid.cell_keys(cell) if key not in done]
    return [items[(task, length, seed)] for _, _, task, length, seed, _ in keys]


def run_grid(
    grid: Grid, settings: RunSettings, records_path: Path, tokenizer: Any
) -> tuple[dict[Key, dict[str, Any]], list[dict[str, Any]]]:
    """Run every missing record of the grid, appending to `records_path`.

    Returns all of the grid's records (stored and new) by key, and the timing of each
    engine built in this run.
    """
    items = build_items(grid, tokenizer, settings)
    done = reusable(load_records(records_path), items, settings.ident)
    cells = grid.cells()
    total = sum(len(grid.cell_keys(c)) for c in cells)
    timings = []
    bar = tqdm(total=total, desc="quality", unit="sample", disable=not settings.progress)
    bar.update(sum(k in done for c in cells for k in grid.cell_keys(c)))
    try:
        for cell in cells:
            pending = pending_items(grid, cell, items, done)
            if not pending:
                continue
            bar.set_postfix_str(cell.label)
            records, timing = run_cell(cell, pending, settings)
            append_records(records_path, records)
            done.update((record_key(r), r) for r in records)
            timings.append(timing)
            bar.update(len(records))
    finally:
        bar.close()
    return done, timings


def run_quality(
    grid: Grid, settings: RunSettings, json_path: str | Path, records_path: str | Path | None = None
) -> dict[str, Any]:
    """Run the grid (resuming from the records file) and write the aggregate JSON report.

    Records go to `records_path` (default: `json_path` with the suffix `.jsonl`).
    Returns the report: metadata, per-cell accuracy and a per-(method, ratio) summary.
    """

    json_path = Path(json_path)
    records_path = Path(records_path) if records_path else json_path.with_suffix(".jsonl")
    if records_path.resolve() == json_path.resolve():
        raise ValueError(f"the records file and the JSON report are both {json_path}")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    records_path.parent.mkdir(parents=True, exist_ok=True)
    for cell in grid.cells():  # fail on a bad setting before anything slow starts
        EngineConfig.from_dict({"model": settings.model, **settings.engine_kwargs(cell)})
    started, t0 = time.time(), time.perf_counter()
    source = _load_source(settings)
    records, timings = run_grid(grid, settings, records_path, source.tokenizer)
    elapsed = time.perf_counter() - t0
    report = build_report(grid, settings, records, timings, started, elapsed)
    report["metadata"]["records_file"] = str(records_path)
    report["metadata"]["model_identity"] = model_identity_of(source)
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
