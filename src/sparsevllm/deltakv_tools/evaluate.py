"""`sparsevllm deltakv eval`: a checkpoint's errors per layer on collected data.

For every compressed layer, the relative K, V and attention-output errors (`losses.py`,
sums pooled over the sequences) of three reconstructions:

- `latent`: the compressor with float latents;
- `int4`: the same with the latents stored as INT4 codes (`deltakv.latent_codes`);
- `references`: the mean of the references alone (no latent: what the centers carry).

The report is JSON (`--json`) and a table on stdout. The data must come from the model
the checkpoint was trained for (the capture's fingerprint is checked); `--split val`
takes the sequences the training held out (the same key hash, the checkpoint's
validation fraction), `--split all` every sequence.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsevllm.deltakv.checkpoint import check_model, load_compressor
from sparsevllm.deltakv.compressor import DeltaKVCompressor, reference_mean
from sparsevllm.deltakv.latent_codes import quantize_latents
from sparsevllm.deltakv.spec import DeltaKVSpec
from sparsevllm.deltakv_tools.capture_set import CaptureSet, open_capture
from sparsevllm.deltakv_tools.dataset import SequenceViews, split_refs
from sparsevllm.deltakv_tools.losses import Reconstruct, pooled_errors, round_trip

SPLITS = ("val", "all")
VARIANTS = ("latent", "int4", "references")


@dataclass(frozen=True)
class EvalSettings:
    checkpoint: Path
    data: Path
    split: str = "val"
    group_size: int = 0
    device: str = "cpu"


def _check_layout(spec: DeltaKVSpec, capture: CaptureSet) -> None:
    lay = capture.layout
    if (lay.num_kv_heads, lay.head_dim) != (spec.num_kv_heads, spec.head_dim):
        raise ValueError(
            f"the capture has {lay.num_kv_heads} KV heads of {lay.head_dim}, the compressor "
            f"{spec.num_kv_heads} of {spec.head_dim}"
        )
    missing = [layer for layer in spec.layers if layer not in lay.layers]
    if missing:
        raise ValueError(f"the capture lacks the compressor's layers {missing}")


def _reconstructions(c: DeltaKVCompressor, layer: int, group: int) -> dict[str, Reconstruct]:
    def int4(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        latent = quantize_latents(c.compress(layer, t, r), group)
        return c.reconstruct(layer, latent, r)

    return {
        "latent": round_trip(c, layer),
        "int4": int4,
        "references": lambda t, r: reference_mean(r),
    }


def evaluate(s: EvalSettings) -> dict[str, object]:
    if s.split not in SPLITS:
        raise ValueError(f"--split must be one of {', '.join(SPLITS)}")
    compressor, info = load_compressor(s.checkpoint, device=s.device)
    capture = open_capture(s.data)
    check_model(info, capture.layout.model)
    _check_layout(info.spec, capture)
    refs = capture.sequences
    if s.split == "val":
        fraction = info.training.get("val_fraction", 0.1)
        refs = split_refs(refs, float(fraction) if isinstance(fraction, (int, float)) else 0.1)[1]
        if not refs:
            raise ValueError(f"{s.data}: no held-out sequence (try --split all)")
    views = SequenceViews(capture.load(refs), capture.layout, info.spec, torch.device(s.device))
    rows = []
    for layer in info.spec.layers:
        row: dict[str, object] = {"layer": layer, "latent_dim": info.spec.latent_dim(layer)}
        for name, fn in _reconstructions(compressor, layer, s.group_size).items():
            row.update({f"{name}_{k}": v for k, v in pooled_errors(views, layer, fn).items()})
        rows.append(row)
    return {
        "checkpoint": str(s.checkpoint),
        "data": str(s.data),
        "split": s.split,
        "model": list(info.model.names),
        "sequences": len(views),
        "tokens": views.num_tokens,
        "int4_group_size": s.group_size,
        "spec": info.spec.to_json(),
        "per_layer": rows,
        "mean": _means(rows),
    }


def _means(rows: list[dict[str, object]]) -> dict[str, float]:
    keys = [k for k in rows[0] if k not in ("layer", "latent_dim")]
    out = {}
    for key in keys:
        values = [float(v) for r in rows if isinstance(v := r.get(key), (int, float))]
        if values:
            out[key] = sum(values) / len(values)
    return out


def format_table(report: dict[str, object]) -> str:
    """The report's per-layer errors as a fixed-width table (percent)."""
    rows = report["per_layer"]
    assert isinstance(rows, list)
    cols = [f"{v}_{p}" for v in VARIANTS for p in ("k", "v", "attn")]
    head = f"{'layer':>5} {'r':>4} " + " ".join(f"{c:>15}" for c in cols)
    lines = [head, "-" * len(head)]
    mean = report["mean"]
    assert isinstance(mean, dict)
    for r in [*rows, {"layer": "mean", "latent_dim": "", **mean}]:
        cells = " ".join(f"{100 * float(r[c]):>14.3f}%" if c in r else f"{'-':>15}" for c in cols)
        lines.append(f"{r['layer']!s:>5} {r['latent_dim']!s:>4} {cells}")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    if args.int4_group < 0:
        raise ValueError("--int4-group must be >= 0")
    report = evaluate(
        EvalSettings(
            Path(args.checkpoint), Path(args.data), args.split, args.int4_group, args.device
        )
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['checkpoint']} on {report['data']} ({report['split']}: "
        f"{report['sequences']} sequences, {report['tokens']} tokens); relative squared errors"
    )
    print(format_table(report))
    return 0
