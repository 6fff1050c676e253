"""`sparsevllm deltakv train`: fit a compressor to a capture, on CPU or CUDA.

Each step draws one training sequence (a seeded generator: a resumed run draws the
same ones) and, over every layer, minimises the mean of
`k_weight x K error + v_weight x V error + attn_weight x attention-output error`
(`losses.py`) with AdamW; the learning rate warms up over the first 3% of the steps and
then follows a cosine down to a tenth. Validation (held-out sequences, `dataset.split_refs`)
runs before the first step and every `eval_every` steps. The run writes, in `out`:
`compressor.safetensors` (the checkpoint), `train_state.pt` (to `--resume`), `log.json`
and `loss.png`; it can stop early (`stop_after` steps, `time_limit_min`) and resume.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from sparsevllm.deltakv.checkpoint import SAVE_DTYPES, save_compressor
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.spec import DeltaKVSpec, stride_of_ratio
from sparsevllm.deltakv_tools.capture_set import CaptureSet, open_capture
from sparsevllm.deltakv_tools.dataset import SequenceViews, split_refs
from sparsevllm.deltakv_tools.losses import (
    LossWeights,
    combined,
    layer_errors,
    layer_mean,
    pooled_errors,
    round_trip,
)
from sparsevllm.deltakv_tools.pca_init import pca_init
from sparsevllm.deltakv_tools.plot import plot_losses
from sparsevllm.deltakv_tools.train_state import (
    FREE_SETTINGS,
    TrainState,
    load_state,
    save_state,
)

CHECKPOINT_FILE = "compressor.safetensors"
INITS = ("pca", "random")


@dataclass(frozen=True)
class TrainSettings:
    data: Path
    out: Path
    latent_dims: tuple[int, ...] = ()  # (): kv_dim // 4; one value: every layer
    hidden_dim: int = 0
    cluster_ratio: float = 0.1
    sink_tokens: int = 4
    num_references: int = 4
    steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 0.0
    weights: LossWeights = field(default_factory=LossWeights)
    val_fraction: float = 0.1
    eval_every: int = 100
    save_every: int = 100
    log_every: int = 10
    init: str = "pca"
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads (None: torch's choice)
    save_dtype: str = "float32"
    stop_after: int | None = None
    time_limit_min: float | None = None
    progress: bool = True

    def check(self) -> None:
        for name in ("steps", "eval_every", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("--lr must be > 0 and --weight-decay >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {', '.join(INITS)}")
        if self.init == "pca" and self.hidden_dim:
            raise ValueError("--init pca needs linear maps (--hidden-dim 0); use --init random")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}")
        if min(asdict(self.weights).values()) < 0:
            raise ValueError("loss weights must be >= 0")
        stride_of_ratio(self.cluster_ratio)

    def fixed(self) -> dict[str, object]:
        """The settings a resumed run must share (plain JSON-like values)."""
        d = asdict(self)
        return {k: _plain(v) for k, v in d.items() if k not in FREE_SETTINGS}


def build_spec(capture: CaptureSet, s: TrainSettings) -> DeltaKVSpec:
    lay = capture.layout
    kv_dim = 2 * lay.num_kv_heads * lay.head_dim
    dims = s.latent_dims or (max(2, kv_dim // 4),)
    if len(dims) == 1:
        dims = dims * len(lay.layers)
    if len(dims) != len(lay.layers):
        raise ValueError(
            f"--latent-dim lists {len(dims)} widths; the capture has {len(lay.layers)} "
            f"layers ({list(lay.layers)}): give one width or one per layer"
        )
    return DeltaKVSpec(
        layers=lay.layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        latent_dims=tuple(dims),
        hidden_dim=s.hidden_dim,
        sink_tokens=s.sink_tokens,
        center_stride=stride_of_ratio(s.cluster_ratio),
        num_references=s.num_references,
    )


def learning_rate(s: TrainSettings, step: int) -> float:
    warm = max(1, round(0.03 * s.steps))
    if step < warm:
        return s.lr * (step + 1) / warm
    t = (step - warm) / max(1, s.steps - warm)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


@dataclass
class Run:
    """Everything a run works on."""

    settings: TrainSettings
    capture: CaptureSet
    compressor: DeltaKVCompressor
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    train: SequenceViews
    val: SequenceViews
    state: TrainState
    command: str


def _setup(s: TrainSettings, resume: bool, command: str) -> Run:
    s.check()
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    capture = open_capture(s.data)
    spec = build_spec(capture, s)
    train_refs, val_refs = split_refs(capture.sequences, s.val_fraction)
    if not train_refs:
        raise ValueError(f"{s.data}: no training sequence left after the validation split")
    device = torch.device(s.device)
    views = [
        SequenceViews(capture.load(r), capture.layout, spec, device) for r in (train_refs, val_refs)
    ]
    torch.manual_seed(s.seed)
    compressor = DeltaKVCompressor(spec).to(device)
    opt = torch.optim.AdamW(compressor.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)
    run = Run(s, capture, compressor, opt, gen, views[0], views[1], TrainState(), command)
    fixed = {**s.fixed(), "spec": spec.to_json(), "data": _data_identity(capture)}
    if resume:
        loaded = load_state(s.out, fixed)
        compressor.load_state_dict({k: v.to(device) for k, v in loaded.weights.items()})
        opt.load_state_dict(loaded.optimizer)
        gen.set_state(loaded.generator)
        run.state = loaded.state
    elif s.init == "pca":
        pca_init(compressor, run.train)
    return run


def _data_identity(capture: CaptureSet) -> dict[str, object]:
    return {
        "model_fingerprint": capture.layout.model_fingerprint,
        "sequences": [r.key for r in capture.sequences],
    }


def _validate(run: Run) -> dict[str, float]:
    views = run.val if len(run.val) else run.train
    c = run.compressor
    per_layer = {
        layer: pooled_errors(views, layer, round_trip(c, layer)) for layer in c.spec.layers
    }
    return layer_mean(per_layer, run.settings.weights)


def _step(run: Run) -> dict[str, float]:
    """One optimizer step on one drawn sequence; the step's losses (mean over layers)."""
    s, c = run.settings, run.compressor
    i = int(torch.randint(len(run.train), (1,), generator=run.generator))
    for group in run.optimizer.param_groups:
        group["lr"] = learning_rate(s, run.state.step)
    spec = c.spec
    total = torch.zeros((), device=run.train.device)
    parts = {"k": 0.0, "v": 0.0, "attn": 0.0}
    for layer in spec.layers:
        view = run.train.view(i, layer)
        e = layer_errors(view, round_trip(c, layer), spec.num_kv_heads, spec.head_dim)
        total = total + combined(e, s.weights)
        parts["k"] += float(e.k.value.detach())
        parts["v"] += float(e.v.value.detach())
        parts["attn"] += float(e.attn.value.detach()) if e.attn is not None else 0.0
    loss = total / len(spec.layers)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    n = len(spec.layers)
    return {"loss": float(loss.detach()), **{k: v / n for k, v in parts.items()}}


def _record_validation(run: Run) -> dict[str, float]:
    entry = {"step": float(run.state.step), **_validate(run)}
    run.state.validation.append(entry)
    return entry


def _training_metadata(run: Run) -> dict[str, object]:
    """What the checkpoint says of its training (safetensors metadata, JSON)."""
    last = run.state.validation[-1] if run.state.validation else {}
    return {
        "data": str(run.settings.data),
        "data_sequences": len(run.capture.sequences),
        "data_tokens": run.train.num_tokens + run.val.num_tokens,
        "val_fraction": run.settings.val_fraction,
        "steps": run.state.step,
        "settings": run.settings.fixed(),
        "validation": last,
        "command": run.command,
    }


def _save(run: Run, finished: bool) -> None:
    s, out = run.settings, run.settings.out
    spec = run.compressor.spec
    fixed = {**s.fixed(), "spec": spec.to_json(), "data": _data_identity(run.capture)}
    save_state(
        out,
        run.state,
        run.compressor.state_dict(),
        run.optimizer.state_dict(),
        run.generator.get_state(),
        fixed,
    )
    model = run.capture.layout.model
    save_compressor(
        out / CHECKPOINT_FILE, run.compressor, model, _training_metadata(run), s.save_dtype
    )
    log = {
        "command": run.command,
        "model": list(model.names),
        "model_fingerprint": model.fingerprint,
        "spec": json.loads(spec.to_json()),
        "settings": s.fixed(),
        "train_sequences": len(run.train),
        "val_sequences": len(run.val),
        "train_tokens": run.train.num_tokens,
        "val_tokens": run.val.num_tokens,
        "torch_threads": torch.get_num_threads(),
        "device": s.device,
        "step": run.state.step,
        "finished": finished,
        "seconds": round(run.state.seconds, 1),
        "history": run.state.history,
        "validation": run.state.validation,
    }
    (out / "log.json").write_text(json.dumps(log, indent=1) + "\n")
    title = (
        f"DeltaKV {', '.join(model.names)}: {len(spec.layers)} layers, latent {spec.latent_dims[0]}"
    )
    plot_losses(out / "loss.png", run.state.history, run.state.validation, title)


def _stop_reason(run: Run, first: int, started: float) -> str | None:
    s = run.settings
    if s.stop_after is not None and run.state.step - first >= s.stop_after:
        return "stop_after"
    if s.time_limit_min is not None and time.perf_counter() - started >= 60 * s.time_limit_min:
        return "time_limit"
    return None


def train(s: TrainSettings, resume: bool = False, command: str = "") -> dict[str, object]:
    """Run (or continue) training; returns a summary of where it ended."""
    run = _setup(s, resume, command)
    s.out.mkdir(parents=True, exist_ok=True)
    if not run.state.validation:
        _record_validation(run)
    started, before = time.perf_counter(), run.state.seconds
    first = run.state.step
    bar = tqdm(total=s.steps, initial=first, desc="DeltaKV train", disable=not s.progress)
    window: list[dict[str, float]] = []
    stopped = None
    while run.state.step < s.steps:
        stopped = _stop_reason(run, first, started)
        if stopped:
            break
        window.append(_step(run))
        run.state.step += 1
        step = run.state.step
        bar.update(1)
        if step % s.log_every == 0 or step == s.steps:
            mean = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
            run.state.history.append(
                {"step": float(step), "lr": learning_rate(s, step - 1), **mean}
            )
            bar.set_postfix(loss=f"{mean['loss']:.4g}")
            window = []
        if step % s.eval_every == 0 or step == s.steps:
            val = _record_validation(run)
            bar.set_postfix(loss=f"{run.state.history[-1]['loss']:.4g}", val=f"{val['loss']:.4g}")
        if step % s.save_every == 0 and step < s.steps:
            run.state.seconds = before + time.perf_counter() - started
            _save(run, finished=False)
    bar.close()
    run.state.seconds = before + time.perf_counter() - started
    finished = run.state.step >= s.steps
    _save(run, finished)
    return {
        "out": str(s.out),
        "checkpoint": str(s.out / CHECKPOINT_FILE),
        "step": run.state.step,
        "finished": finished,
        "stopped": stopped,
        "seconds": round(run.state.seconds, 1),
        "validation": run.state.validation[-1],
        "first_validation": run.state.validation[0],
    }


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def run_cli(args: argparse.Namespace) -> int:
    settings = TrainSettings(
        data=Path(args.data),
        out=Path(args.out),
        latent_dims=tuple(args.latent_dim),
        hidden_dim=args.hidden_dim,
        cluster_ratio=args.cluster_ratio,
        sink_tokens=args.sink,
        num_references=args.references,
        steps=args.steps,
        lr=args.lr,
        weight_decay=args.weight_decay,
        weights=LossWeights(args.k_weight, args.v_weight, args.attn_weight),
        val_fraction=args.val_fraction,
        eval_every=args.eval_every,
        save_every=args.save_every,
        log_every=args.log_every,
        init=args.init,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        save_dtype=args.save_dtype,
        stop_after=args.stop_after,
        time_limit_min=args.time_limit,
        progress=not args.no_progress,
    )
    summary = train(settings, args.resume, str(getattr(args, "command_line", "sparsevllm deltakv")))
    print(json.dumps(summary, indent=2))
    return 0
