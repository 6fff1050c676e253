"""Scoring passes: extra forwards a method asks for at the end of a prompt (KVzip's
context reconstruction), run over the sequence's resident views.

Each input of a pass (`ScoringInput`: text the host tokenizes, spans of the sequence's
own prompt tokens) runs as one single-sequence prefill after the step's forward and
before the methods' `after_step`. Its tokens take the positions after the sequence's
last one and store their K/V in *scratch* slots: rows that every layer's storage holds
after its group's pool slots (`KVLayout.create`), which the pool never hands out. The
pass attends through a table of its own (the sequence's device slot-table row, then the
scratch slots), so the pool, the slot tables, admission and the other sequences never
see it, and its KV is gone when the next input overwrites the scratch. The backend hands
the input's queries and keys to the method (`observe_scoring`); logits are not computed.

The cost is counted (`ScoringCost`: passes, forwards, tokens, wall time with the device
synchronised around each step's passes) for `stats()` and the throughput benchmark.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsevllm.attention.backend import AttentionBackend, ForwardBatch
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.engine.method_set import ScoringRequest
from sparsevllm.engine.step_plan import StepPlan
from sparsevllm.sparse.base import ScoringInput
from sparsevllm.upload import upload

# The model as the pass runs it: (input ids `[T]`, batch) -> hidden states `[T, hidden]`.
ModelForward = Callable[[torch.Tensor, ForwardBatch], torch.Tensor]


@dataclass
class ScoringCost:
    """What scoring passes have cost since the last reset."""

    passes: int = 0  # sequences scored
    forwards: int = 0
    tokens: int = 0  # tokens run through the model
    seconds: float = 0.0  # wall time, the device synchronised before and after

    def as_dict(self) -> dict[str, float]:
        return {
            "scoring_passes": self.passes,
            "scoring_forwards": self.forwards,
            "scoring_tokens": self.tokens,
            "scoring_seconds": self.seconds,
        }


class ScoringPasses:
    """Runs the scoring passes of a step (see the module docstring)."""

    def __init__(
        self,
        model: ModelForward,
        backend: AttentionBackend,
        encode: Callable[[str], list[int]] | None,
        group_slots: list[int],
        scratch: int,
        group_of_layer: list[int],
        max_model_len: int,
        device: torch.device,
    ) -> None:
        """`group_slots`: each pool group's slot count (its scratch rows follow);
        `scratch`: scratch rows per layer; `encode`: the tokenizer (None: text pieces
        are dropped)."""
        self.model = model
        self.backend = backend
        self.encode = encode
        self.scratch = scratch
        self.group_of_layer = group_of_layer
        self.max_model_len = max_model_len
        self.device = device
        self.cost = ScoringCost()
        base = torch.tensor(group_slots, dtype=torch.long, device=device)
        self._slots = base[:, None] + torch.arange(scratch, device=device)  # [G, scratch]
        self._texts: dict[str, list[int]] = {}

    def reset(self) -> None:
        self.cost = ScoringCost()

    def run(self, requests: list[ScoringRequest], plan: StepPlan, tables: torch.Tensor) -> None:
        """Every request's inputs, one forward each; `tables` are the device slot tables
        `[G, rows, max_len]`, in sync with the step's views."""
        if not requests:
            return
        self._sync()
        began = time.perf_counter()
        for req in requests:
            i = req.step.row
            prompt = plan.prompts[i]
            if prompt is None:
                raise RuntimeError("a scoring pass was asked for a step that does not end a prompt")
            inputs = [self.token_ids(inp, prompt) for inp in req.inputs]
            longest = max(map(len, inputs))
            if longest > self.scratch:
                raise RuntimeError(
                    f"{req.method.name}: a scoring input of {longest} tokens exceeds the "
                    f"{self.scratch} scratch slots its scoring_slots() declared"
                )
            lens = [plan.view_lens[g][i] for g in range(len(plan.view_lens))]
            table = self._table(tables, plan.rows[i], lens, longest)
            for index, ids in enumerate(inputs):
                if ids:
                    self._forward(req, index, ids, table, lens)
            self.cost.passes += 1
        self._sync()
        self.cost.seconds += time.perf_counter() - began

    def token_ids(self, inp: ScoringInput, prompt: list[int]) -> list[int]:
        """The input's tokens: text pieces tokenized (cached), spans cut from `prompt`."""
        ids: list[int] = []
        for piece in inp.pieces:
            if isinstance(piece, str):
                ids += self._text(piece)
            else:
                a, b = piece
                ids += prompt[a:b]
        return ids

    def _text(self, text: str) -> list[int]:
        if self.encode is None:
            return []
        found = self._texts.get(text)
        if found is None:
            found = self._texts[text] = self.encode(text)
        return found

    def _table(self, tables: torch.Tensor, row: int, lens: list[int], n: int) -> torch.Tensor:
        """`[G, 1, max(lens) + n]`: the row's views, each followed by n scratch slots."""
        groups, width = len(lens), max(lens)
        table = torch.zeros((groups, 1, width + n), dtype=torch.int32, device=self.device)
        table[:, 0, :width] = tables[:, row, :width]
        at = upload(lens, torch.long, self.device)[:, None] + torch.arange(n, device=self.device)
        table[:, 0].scatter_(1, at, self._slots[:, :n].to(torch.int32))
        return table

    def _forward(
        self, req: ScoringRequest, index: int, ids: list[int], table: torch.Tensor, lens: list[int]
    ) -> None:
        n, dev = len(ids), self.device
        start = max(0, min(req.step.end, self.max_model_len - n))
        view_lens = [[length + n] for length in lens]
        packed = upload([*ids, 0, n, *(length + n for length in lens)], torch.long, dev)
        input_ids, q_starts, view_lens_t = torch.split(packed, [n, 2, len(lens)])
        zero = torch.zeros(1, dtype=torch.int32, device=dev)
        batch = ForwardBatch(
            positions=torch.arange(start, start + n, device=dev),
            q_starts=[0],
            q_lens=[n],
            slot_mapping=self._slots[:, :n],
            tables=table,
            rows=[0],
            view_lens=view_lens,
            group_of_layer=self.group_of_layer,
            logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
            backend=self.backend,
            rows_t=zero,
            view_lens_t=view_lens_t.int()[:, None],
            q_starts_t=q_starts.int(),
            sparse=SparseStep(
                score_rows=[0],
                score_rows_t=zero,
                decode_t=torch.zeros(1, dtype=torch.bool, device=dev),
                kv=req.kv,
                query_rows=[n],
                observe_queries=req.observer(index),
            ),
        )
        self.model(input_ids, batch)
        self.cost.forwards += 1
        self.cost.tokens += n

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
