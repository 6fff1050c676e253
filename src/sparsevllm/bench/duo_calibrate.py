"""`sparsevllm calibrate duoattention`: per-KV-head scores for the `duoattention` method.

DuoAttention (Xiao et al., 2024) learns one gate alpha per KV head by distillation: on
synthetic passkey-retrieval samples, the final hidden states at the answer positions of
the model whose attention output is alpha x full + (1 - alpha) x streaming (sink + recent)
should match the full model's (mean squared error), with an L1 penalty pulling the gates
down; heads with large gates are retrieval heads. Optimising the gates takes thousands
of forward and backward passes over long samples, far more than a CPU allows, so this
command measures the objective directly instead: a head's score is the paper's
distillation loss when that head alone streams and every other head attends in full,

    loss_h = mean over answer positions i of mean_c (h_full[i, c] - h_{h streams}[i, c])^2

averaged over the samples and divided by the largest head's (so scores lie in [0, 1]).
Heads the model cannot do without at the answer (the retrieval heads) score high. Under a
quadratic model of the loss with no interaction between heads, the paper's optimal gates
are a monotone function of these losses, so ranking by them picks the same heads at any
sparsity; where heads interact (two heads that can stand in for each other), the gates
and these scores can rank differently.

The samples are the quality suite's needle tasks (`bench/quality`), each prompt followed
by its answer (the labels), as the paper's passkey samples are. One forward pass per
managed KV head and sample, plus one full pass: the cost grows with heads x samples x
length^2. The model runs through its own modules with a plain torch attention (every
head full, the chosen head streaming with the Lambda-shaped mask: a query sees the first
`sink` tokens and the `recent` ones before it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsevllm.bench.quality import generate
from sparsevllm.bench.quality.settings import ANSWER_SEP
from sparsevllm.calibration import model_identity
from sparsevllm.calibration.head_scores import (
    DEFAULT_HEAD_SCORES_DIR,
    HeadScores,
    write_head_scores,
)
from sparsevllm.calibration.identity import calibration_file_name
from sparsevllm.calibration.schema import ModelIdentity, dumps
from sparsevllm.models.loader import ModelSource, build_model, load_model_source
from sparsevllm.sparse.duoattention import streaming_count

DEFAULT_TASKS = ("niah_multikey", "niah_single")
SCORING = (
    "DuoAttention's distillation loss (mean squared error of the final hidden states at "
    "the answer positions) when the head alone streams (sink + recent, Lambda mask) and "
    "every other head attends in full; averaged over the samples, divided by the largest"
)


@dataclass(frozen=True)
class Settings:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    length: int = 512
    samples: int = 4
    seed: int = 0
    sink: int = 4
    recent: int = 32
    dtype: str = "float32"
    device: str = "cpu"


class _Batch:
    """The two fields the model modules read of a `ForwardBatch` (one sequence)."""

    def __init__(self, positions: torch.Tensor, backend: AblationAttention) -> None:
        self.positions = positions
        self.backend = backend


class AblationAttention:
    """Causal attention of one sequence in plain torch; at most one (layer, KV head)
    streams: its query heads see only the first `sink` tokens and the `recent` ones
    before themselves (a query always sees itself)."""

    def __init__(self, length: int, sink: int, recent: int, device: torch.device) -> None:
        i = torch.arange(length, device=device)
        self.causal = i[:, None] >= i[None, :]
        lag = i[:, None] - i[None, :]
        self.streaming = self.causal & ((i[None, :] < sink) | (lag <= recent))
        self._lag = lag
        self.ablate: tuple[int, int] | None = None

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: object,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        mask = self.causal if window is None else self.causal & (self._lag < window)
        qt = q.transpose(0, 1)  # [Hq, T, D]
        kt = k.transpose(0, 1).repeat_interleave(group, dim=0)
        vt = v.transpose(0, 1).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
        if self.ablate is not None and self.ablate[0] == layer:
            h = slice(self.ablate[1] * group, (self.ablate[1] + 1) * group)
            out[h] = F.scaled_dot_product_attention(
                qt[h], kt[h], vt[h], attn_mask=self.streaming & mask, scale=scale
            )
        return out.transpose(0, 1)


def managed_layers(model: torch.nn.Module, num_layers: int) -> list[int]:
    """The layers a sparse method manages: all but the sliding-window ones."""
    sliding = getattr(model, "sliding_window_layers", lambda: [])()
    skip = {layer for layer, _ in sliding}
    return [layer for layer in range(num_layers) if layer not in skip]


def make_sample(tokenizer: Any, task: str, settings: Settings, index: int) -> tuple[list[int], int]:
    """Token ids of one sample (prompt, answer prefix, answer) and how many answer tokens
    end it."""
    depth = None if settings.samples == 1 else index / (settings.samples - 1)
    sample = generate(task, tokenizer, settings.length, settings.seed + index, depth)
    prompt = list(tokenizer.encode(sample.prompt + ANSWER_SEP + sample.answer_prefix))
    answer = " " + ", ".join(sample.answers)
    tail = list(tokenizer.encode(answer, add_special_tokens=False))
    return prompt + tail, len(tail)


def score_heads(
    model: torch.nn.Module,
    samples: Sequence[tuple[list[int], int]],
    layers: Sequence[int],
    num_kv_heads: int,
    sink: int,
    recent: int,
    device: torch.device,
    progress: bool = True,
) -> dict[int, list[float]]:
    """Mean distillation loss per (layer, KV head) when that head alone streams."""
    heads = [(layer, h) for layer in layers for h in range(num_kv_heads)]
    loss = {pair: 0.0 for pair in heads}
    bar = tqdm(
        total=len(samples) * (len(heads) + 1),
        desc="DuoAttention head scores",
        unit="pass",
        disable=not progress,
    )
    with torch.inference_mode():
        for ids, num_answer in samples:
            t = len(ids)
            attention = AblationAttention(t, sink, recent, device)
            batch = _Batch(torch.arange(t, device=device), attention)
            tokens = torch.tensor(ids, device=device)
            # The positions whose next token is an answer token.
            at = torch.arange(t - num_answer - 1, t - 1, device=device)
            full = model(tokens, batch)[at].float()
            bar.update(1)
            for pair in heads:
                attention.ablate = pair
                out = model(tokens, batch)[at].float()
                loss[pair] += float((out - full).pow(2).mean(dim=-1).mean()) / len(samples)
                bar.update(1)
            attention.ablate = None
    bar.close()
    top = max(loss.values(), default=0.0)
    by_layer: dict[int, list[float]] = {}
    for (layer, h), value in loss.items():
        by_layer.setdefault(layer, [0.0] * num_kv_heads)[h] = value / top if top > 0 else 0.0
    return by_layer


def calibrate(
    model_path: str | None,
    settings: Settings,
    command: str,
    names: Sequence[str] = (),
    progress: bool = True,
) -> tuple[HeadScores, float]:
    """Score the model's heads; (the head scores, seconds it took)."""
    started = time.perf_counter()
    source = load_model_source(model_path, None, "auto")
    if source.tokenizer is None:
        raise ValueError(f"{source.path}: calibrating needs a model with a tokenizer")
    hf = source.hf_config
    if getattr(hf, "kv_lora_rank", None):
        raise ValueError("duoattention does not serve latent (MLA) KV caches")
    device = torch.device(settings.device)
    dtype = getattr(torch, settings.dtype)
    max_len = settings.length * 2 + 256
    model = build_model(source, max_len, dtype, device, settings.seed)
    num_layers = hf.num_hidden_layers
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    layers = managed_layers(model, num_layers)
    tasks = settings.tasks
    samples = [
        make_sample(source.tokenizer, tasks[i % len(tasks)], settings, i)
        for i in range(settings.samples)
    ]
    by_layer = score_heads(
        model, samples, layers, num_kv_heads, settings.sink, settings.recent, device, progress
    )
    seconds = time.perf_counter() - started
    base = _identity(source)
    identity = ModelIdentity(tuple(dict.fromkeys([*base.names, *names])), base.fingerprint)
    recorded = {
        **settings.__dict__,
        "tasks": list(tasks),
        "sample_tokens": [len(ids) for ids, _ in samples],
        "seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
    }
    scores = HeadScores(
        model=identity,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        scores=tuple(
            tuple(round(s, 6) for s in by_layer[layer]) if layer in by_layer else None
            for layer in range(num_layers)
        ),
        scoring=SCORING,
        settings=recorded,
        date=datetime.date.today().isoformat(),
        command=command,
    )
    return scores, seconds


def _identity(source: ModelSource) -> ModelIdentity:
    return model_identity(source.path, source.hf_config.to_dict())


def build_parser(parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = parser_class(
        prog="sparsevllm calibrate duoattention",
        description="Compute DuoAttention's per-KV-head scores for a model on generated "
        "needle-in-a-haystack samples and write its head-score file, which the "
        "duoattention method reads (docs/calibration.md). A head's score is DuoAttention's "
        "distillation loss when it alone streams (sink + recent), relative to the largest; "
        "the paper optimises gates instead (docs/methods.md says where this differs). "
        "Prints a JSON summary. Cost: (managed KV heads + 1) forward passes per sample.",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="Model directory, .gguf file or config.json (default: the bundled default model).",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help=f"Head-score file to write (default: {DEFAULT_HEAD_SCORES_DIR}/<model name>.json, "
        "where duoattention finds the files it ships).",
    )
    p.add_argument(
        "--tasks",
        default=",".join(DEFAULT_TASKS),
        help="Comma-separated quality tasks whose samples (prompt + answer) are scored, "
        f"used in turn (default: {','.join(DEFAULT_TASKS)}).",
    )
    p.add_argument(
        "--length",
        type=int,
        default=512,
        help="Prompt length of a sample in tokens (default: 512).",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=4,
        help="Number of samples; the needle depth runs evenly from 0 to 1 (default: 4).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the first sample (default: 0).")
    p.add_argument(
        "--sink",
        type=int,
        default=4,
        help="Sink tokens of a streaming head while scoring (default: 4, the engine's "
        "sink_keep_tokens).",
    )
    p.add_argument(
        "--recent",
        type=int,
        default=32,
        help="Recent tokens of a streaming head while scoring (default: 32, the engine's "
        "recent_keep_tokens).",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="Weights and activations dtype (default: float32).",
    )
    p.add_argument("--device", default="cpu", help="Torch device to run on (default: cpu).")
    p.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help="Another name the model answers to (repeatable), besides its file or "
        "directory name and its HF name.",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="Do not show the progress bar (stderr)."
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    for name, value, low in (
        ("--length", args.length, 8),
        ("--samples", args.samples, 1),
        ("--sink", args.sink, 0),
        ("--recent", args.recent, 1),
    ):
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not tasks:
        raise ValueError("--tasks names no task")
    same = ("length", "samples", "seed", "sink", "recent", "dtype", "device")  # flag = field
    settings = Settings(tasks=tasks, **{name: getattr(args, name) for name in same})
    scores, seconds = calibrate(
        args.model, settings, _command(args), args.name, not args.no_progress
    )
    out = (
        Path(args.out)
        if args.out
        else DEFAULT_HEAD_SCORES_DIR / calibration_file_name(scores.model)
    )
    write_head_scores(scores, out)
    print(dumps(summary(scores, out, seconds)))
    return 0


def summary(scores: HeadScores, out: Path, seconds: float) -> dict[str, object]:
    """What the command prints: the file, the model, and how many heads stream at the
    default sparsity (0.5) by layer."""
    pairs = sorted(
        (s, layer, h)
        for layer, row in enumerate(scores.scores)
        if row is not None
        for h, s in enumerate(row)
    )
    n = streaming_count(len(pairs), 0.5)
    streaming: dict[int, int] = {}
    for _, layer, _h in pairs[:n]:
        streaming[layer] = streaming.get(layer, 0) + 1
    whole = [layer for layer, count in streaming.items() if count == scores.num_kv_heads]
    return {
        "out": str(out),
        "model": list(scores.model.names),
        "managed_heads": len(pairs),
        "streaming_at_sparsity_0.5": n,
        "layers_streaming_whole_at_0.5": sorted(whole),
        "seconds": round(seconds, 1),
        "settings": json.loads(json.dumps(dict(scores.settings))),
    }


def _command(args: argparse.Namespace) -> str:
    words = ["sparsevllm", "calibrate", "duoattention"]
    if args.model:
        words += ["--model", args.model]
    words += ["--tasks", args.tasks, "--length", str(args.length), "--samples", str(args.samples)]
    words += ["--seed", str(args.seed), "--sink", str(args.sink), "--recent", str(args.recent)]
    words += ["--dtype", args.dtype, "--device", args.device]
    for name in args.name:
        words += ["--name", name]
    if args.out:
        words += ["--out", args.out]
    return shlex.join(words)
