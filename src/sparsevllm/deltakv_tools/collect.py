"""`sparsevllm deltakv collect`: run the engine on text and save what DeltaKV trains on.

One engine serves two methods: vanilla (the model's own generations for the prompt
source) and the capture method (`capture.py`, registered for this engine only), which
records each sequence's pre-RoPE K, V and its last queries at every managed layer while
the engine prefills it. Sequences run one at a time, so records arrive in order; they are
written to shards (`shards.py`) until the size cap would be passed.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from tqdm.auto import tqdm

from sparsevllm.deltakv_tools import sources
from sparsevllm.deltakv_tools.capture import NAME, DeltaKVCapture, registered
from sparsevllm.deltakv_tools.shards import CaptureLayout, ShardWriter, estimate_bytes
from sparsevllm.kv.layout import GQA
from sparsevllm.llm import LLM
from sparsevllm.sampling import SamplingParams


@dataclass(frozen=True)
class CollectSettings:
    out: Path
    model: str | None = None
    prompts: Path | None = None
    haystacks: tuple[str, ...] = ()
    haystack_length: int = 2048
    haystack_samples: int = 8
    files: tuple[Path, ...] = ()
    max_tokens: int = 2048
    min_tokens: int = 64
    max_new_tokens: int = 256
    temperature: float = 0.7
    chat: bool = False
    queries: int = 64
    max_bytes: int = 1 << 30
    shard_bytes: int = 256 << 20
    dtype: str = "float16"
    model_dtype: str = "auto"
    device: str = "auto"
    cpu_threads: int | None = None
    seed: int = 0
    progress: bool = True

    def check(self) -> None:
        """Input errors, before a model is loaded."""
        if not (self.prompts or self.haystacks or self.files):
            raise ValueError("nothing to collect: give --prompts, --haystacks or --files")
        if self.min_tokens < 2 or self.max_tokens < self.min_tokens:
            raise ValueError("--max-tokens must be >= --min-tokens >= 2")
        if self.prompts and not 1 <= self.max_new_tokens < self.max_tokens:
            raise ValueError("--max-new-tokens must lie in [1, --max-tokens)")
        if self.max_bytes <= 0 or self.shard_bytes <= 0:
            raise ValueError("--max-gb and --shard-mb must be positive")
        if self.haystack_samples < 0 or self.haystack_length < 1:
            raise ValueError("--haystack-samples must be >= 0, --haystack-length >= 1")
        sources.check_tasks(self.haystacks)
        sources.check_files(self.files)
        if self.prompts is not None:
            sources.read_prompts(self.prompts)


def _engine(s: CollectSettings) -> LLM:
    return LLM(
        s.model,
        sparse_method=NAME,
        sparse_methods=["vanilla"],
        deltakv_capture_queries=s.queries,
        enable_prefix_caching=False,
        max_model_len=s.max_tokens + 1,
        dtype=s.model_dtype,
        device=s.device,
        cpu_threads=s.cpu_threads,
        seed=s.seed,
    )


def attention_scales(model: torch.nn.Module) -> dict[int, float]:
    """Each attention module's scale by its layer (the modules that carry `layer_idx`
    and `scale`, as every model family here does)."""
    found: dict[int, float] = {}
    for m in model.modules():
        layer, scale = getattr(m, "layer_idx", None), getattr(m, "scale", None)
        if isinstance(layer, int) and isinstance(scale, float):
            found[layer] = scale
    return found


def capture_layout(llm: LLM, method: DeltaKVCapture, dtype: str) -> CaptureLayout:
    """The layout of this engine's captures; refuses latent (MLA) KV caches."""
    runner = llm.engine.runner
    if runner.slot_layout.name != GQA:
        raise ValueError("DeltaKV compresses per-head K/V; this model caches MLA latent rows")
    scales = attention_scales(cast(torch.nn.Module, runner.model))
    missing = [layer for layer in method.layers if layer not in scales]
    if missing:
        raise ValueError(f"no attention scale found for layers {missing}")
    model = method.model
    return CaptureLayout(
        model_names=model.names if model else (),
        model_fingerprint=model.fingerprint if model else None,
        layers=method.layers,
        num_heads=int(runner.hf_config.num_attention_heads),
        num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim,
        scales={layer: scales[layer] for layer in method.layers},
        dtype=dtype,
    )


def prompt_items(llm: LLM, s: CollectSettings) -> list[sources.TextItem]:
    """The prompt file's prompts, each followed by the model's own continuation."""
    assert s.prompts is not None
    room = s.max_tokens - s.max_new_tokens
    prompts = []
    for entry in sources.read_prompts(s.prompts):
        if entry.messages is not None:
            ids = llm.apply_chat_template(list(entry.messages))
        elif s.chat:
            ids = llm.apply_chat_template([{"role": "user", "content": entry.text or ""}])
        else:
            ids = list(llm.tokenizer.encode(entry.text or ""))
        prompts.append(ids[-room:])
    params = [
        SamplingParams(
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            seed=s.seed + i,
            sparse_method="vanilla",
        )
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=s.progress)
    return [
        sources.TextItem(f"prompts:{i}", "prompts", p + list(o.outputs[0].token_ids))
        for i, (p, o) in enumerate(zip(prompts, outs))
    ]


def _items(llm: LLM, s: CollectSettings) -> list[sources.TextItem]:
    items = prompt_items(llm, s) if s.prompts else []
    tok = llm.tokenizer
    if s.haystacks:
        items += sources.haystack_items(
            tok, s.haystacks, s.haystack_length, s.haystack_samples, s.seed, s.max_tokens
        )
    items += sources.file_items(tok, s.files, s.max_tokens, s.min_tokens)
    items = [item for item in items if len(item.ids) >= s.min_tokens]
    if not items:
        raise ValueError(f"the sources hold no sequence of --min-tokens ({s.min_tokens}) tokens")
    return items


def collect(s: CollectSettings, command: str) -> dict[str, object]:
    """Capture every source's sequences into `s.out`; returns the manifest."""
    s.check()
    started = time.perf_counter()
    with registered():
        llm = _engine(s)
        try:
            method = llm.engine.method
            assert isinstance(method, DeltaKVCapture)
            layout = capture_layout(llm, method, s.dtype)
            if llm.tokenizer is None:
                raise ValueError("collecting needs a model with a tokenizer")
            items = _items(llm, s)
            writer = ShardWriter(s.out, layout, s.max_bytes, s.shard_bytes)
            stopped = _capture(llm, method, items, writer, s)
        finally:
            llm.close()
    extra: dict[str, object] = {
        "command": command,
        "settings": {k: _plain(v) for k, v in asdict(s).items()},
        "stopped_at_cap": stopped,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return writer.finish(extra)


def _capture(
    llm: LLM,
    method: DeltaKVCapture,
    items: Sequence[sources.TextItem],
    writer: ShardWriter,
    s: CollectSettings,
) -> bool:
    """Capture the items in turn; True when the size cap stopped it early."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    bar = tqdm(items, desc="DeltaKV capture", unit="seq", disable=not s.progress)
    for item in bar:
        if (
            writer.bytes_used + estimate_bytes(writer.layout, len(item.ids), s.queries)
            > s.max_bytes
        ):
            bar.close()
            return True
        llm.generate([item.ids], params, use_tqdm=False)
        (record,) = method.take()
        if not writer.add(item.key, item.source, record, item.ids):
            bar.close()
            return True
    return False


def _plain(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def run_cli(args: argparse.Namespace) -> int:
    settings = CollectSettings(
        out=Path(args.out),
        model=args.model,
        prompts=Path(args.prompts) if args.prompts else None,
        haystacks=tuple(t.strip() for t in args.haystacks.split(",") if t.strip()),
        haystack_length=args.haystack_length,
        haystack_samples=args.haystack_samples,
        files=tuple(Path(f) for f in args.files),
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        chat=args.chat,
        queries=args.queries,
        max_bytes=int(args.max_gb * 2**30),
        shard_bytes=int(args.shard_mb * 2**20),
        dtype=args.dtype,
        model_dtype=args.model_dtype,
        device=args.device,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
        progress=not args.no_progress,
    )
    if args.queries < 0:
        raise ValueError("--queries must be >= 0")
    manifest = collect(settings, str(getattr(args, "command_line", "sparsevllm deltakv")))
    keep = ("num_sequences", "num_tokens", "bytes", "max_bytes", "stopped_at_cap", "seconds")
    print(json.dumps({"out": args.out, **{k: manifest[k] for k in keep}}, indent=2))
    return 0
