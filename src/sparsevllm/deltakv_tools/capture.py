"""The capture method: a dense `SparseMethod` that records what DeltaKV compresses.

`sparsevllm deltakv collect` registers it for its own engine only (`registered`), so it
never appears among the served methods elsewhere. It reads nothing but the contract:

- `prefill_query_rows` / `observe_queries`: the post-RoPE queries of the prompt's last
  `deltakv_capture_queries` positions, at every managed layer (what attention-output
  distillation needs: the queries that read the longest context);
- `after_step`, when a step finishes the prompt: every managed layer's K and V of the
  whole prompt (`KVAccess.keys` / `values`, dequantized), the keys turned back to
  pre-RoPE with the model's `rope_frequencies` (what the compressor consumes).

Attention itself is vanilla's: the method keeps every token. One record per prompt, in
the order prompts finish; the driver takes them with `take()`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sparsevllm.calibration.schema import ModelIdentity
from sparsevllm.deltakv.rope import unrotate
from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep, SparseMethod
from sparsevllm.sparse.registry import register_method, unregister_method
from sparsevllm.sparse.spec import MethodKnobs, MethodSpec, knob

NAME = "deltakv_capture"


@dataclass(frozen=True)
class CaptureKnobs(MethodKnobs):
    deltakv_capture_queries: int = knob(
        64, "Newest prompt positions whose queries are recorded per layer.", minimum=0
    )


@dataclass
class CapturedSequence:
    """One prompt's capture, on the host: per managed layer, pre-RoPE keys and values
    `[T, Hkv, D]` float32, post-RoPE queries `[Q, Hq, D]` float32 at `query_positions`
    `[Q]` int64 (the prompt's last Q positions), and the RoPE frequencies `[D/2]`."""

    length: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    query_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    rope: dict[int, torch.Tensor | None] = field(default_factory=dict)


class DeltaKVCapture(SparseMethod):
    name = NAME
    knobs: CaptureKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self.model: ModelIdentity | None = None
        self._queries: dict[tuple[int, int], list[torch.Tensor]] = {}  # (seq, layer) -> rows
        self._done: list[CapturedSequence] = []

    def bind_model(self, model: ModelIdentity) -> None:
        self.model = model

    def _first_query(self, step: SeqStep) -> int:
        return max(0, step.prompt_len - self.knobs.deltakv_capture_queries)

    def prefill_query_rows(self, step: SeqStep) -> int:
        first = max(self._first_query(step), step.start)
        if first >= min(step.end, step.prompt_len):
            return 0
        return step.end - first

    def observe_queries(self, layer: int, step: SeqStep, q: torch.Tensor, kv: KVAccess) -> None:
        start = step.end - q.shape[0]
        n = min(step.end, step.prompt_len) - start  # rows past the prompt: a recompute
        rows = q[:n].detach().float().cpu().clone()  # [n, Hq, D]
        self._queries.setdefault((step.seq_id, layer), []).append(rows)

    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        for step in steps:
            if step.finishes_prompt:
                self._done.append(self._record(step, kv))

    def _record(self, step: SeqStep, kv: KVAccess) -> CapturedSequence:
        length = step.prompt_len
        first = self._first_query(step)
        rec = CapturedSequence(length, query_positions=torch.arange(first, length))
        positions = torch.arange(length, device=kv.device)
        for layer in self.layers:
            freqs = kv.rope_frequencies(layer)
            k = kv.keys(step.seq_id, layer, 0, length)  # [T, Hkv, D] post-RoPE
            rec.keys[layer] = unrotate(k, positions, freqs).cpu()
            rec.values[layer] = kv.values(step.seq_id, layer, 0, length).float().cpu()
            rows = self._queries.pop((step.seq_id, layer), [])
            rec.queries[layer] = torch.cat(rows) if rows else torch.zeros(0)
            if rows and rec.queries[layer].shape[0] != rec.query_positions.numel():
                raise RuntimeError(
                    f"layer {layer}: {rec.queries[layer].shape[0]} queries captured for "
                    f"{rec.query_positions.numel()} positions"
                )
            rec.rope[layer] = None if freqs is None else freqs.float().cpu()
        return rec

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._queries if key[0] == seq_id]:
            del self._queries[key]

    def take(self) -> list[CapturedSequence]:
        """The records of the prompts finished since the last call, in order."""
        done, self._done = self._done, []
        return done


SPEC = MethodSpec(
    name=NAME,
    family="dense",
    description="dense attention that records K, V and queries for DeltaKV training "
    "(registered by `sparsevllm deltakv collect` only)",
    method=DeltaKVCapture,
    knobs=CaptureKnobs,
)


@contextmanager
def registered() -> Iterator[None]:
    """The capture method is a method name only inside this block."""
    register_method(SPEC)
    try:
        yield
    finally:
        unregister_method(NAME)
