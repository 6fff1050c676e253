"""Attention backends: prefill and decode attention over per-layer slot tables.

A backend owns nothing but references to the runner's KV tensors. Each call stores
the new tokens' K/V into their slots, then attends every new query to its sequence's
view (the ordered slots it may read, ending with the new tokens themselves).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

from sparsevllm.attention.scratch import StepScratch

if TYPE_CHECKING:
    # Type-only: attention carries the sparse layer's step records and KV access to the
    # method's select_views without reading them (import-linter skips these imports).
    from sparsevllm.sparse.base import KVAccess, SeqStep


@dataclass
class ForwardBatch:
    """Everything one model forward needs to know about the step's batch.

    Tokens of all scheduled sequences are flattened: sequence i owns query rows
    `q_starts[i] : q_starts[i] + q_lens[i]`.
    """

    positions: torch.Tensor  # [T] logical positions (RoPE)
    q_starts: list[int]
    q_lens: list[int]
    slot_mapping: torch.Tensor  # [G, T] slot of every new token, per layer group
    tables: torch.Tensor  # [G, num_rows, max_len] int32 device-resident slot tables
    rows: list[int]  # table row of each sequence
    view_lens: list[list[int]]  # [G][S] view length of each sequence after this step
    group_of_layer: list[int]
    logits_indices: torch.Tensor  # [S] rows whose hidden state is turned into logits
    backend: AttentionBackend
    # Device copies of the per-sequence metadata, for kernels.
    rows_t: torch.Tensor  # [S] int32
    view_lens_t: torch.Tensor  # [G, S] int32
    q_starts_t: torch.Tensor  # [S + 1] int32
    # Per sequence: a generation step (SeqStep.is_decode) and its score_rows, on device.
    decode_t: torch.Tensor  # [S] bool
    score_rows_t: torch.Tensor  # [S] int32
    # The runner's KV operations, read-only context for select_views.
    kv: KVAccess
    # Sparse-method requests (see sparse/base.py). score_rows[i] > 0 asks for the summed
    # attention probabilities of sequence i's last score_rows[i] queries over its view, at
    # score_layers (None: every layer): per row in scores[layer][i] as [num_heads, L_i], or,
    # from the decode kernel, for the whole batch in step_scores[layer] as [S, num_heads, W]
    # (W >= every view length; zero past a row's view). Read them through `row_scores` /
    # `dense_scores`, which accept either form.
    score_rows: list[int] = field(default_factory=list)
    score_layers: frozenset[int] | None = None
    scores: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    step_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    # The method's batched decode views (`SelectViews`, below); None: every view whole.
    select_views: SelectViews | None = None
    # Read-only context for select_views: the methods' per-sequence step records.
    steps: list[SeqStep] = field(default_factory=list)
    # Scratch space for a method's per-step results (lives exactly as long as the step).
    method_cache: StepScratch = field(default_factory=StepScratch)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def decode_only(self) -> bool:
        """Every sequence has exactly one new query (the decode kernel's case)."""
        return all(n == 1 for n in self.q_lens)

    def max_view_len(self, group: int) -> int:
        return max(self.view_lens[group])

    def view(self, group: int, i: int) -> torch.Tensor:
        """Slot ids of sequence i's view in a layer group: `[L_i]` int64."""
        return self.tables[group, self.rows[i], : self.view_lens[group][i]].long()

    def wants_scores(self, layer: int, i: int) -> int:
        if not self.score_rows or not self.score_rows[i]:
            return 0
        if self.score_layers is not None and layer not in self.score_layers:
            return 0
        return self.score_rows[i]

    def put_scores(self, layer: int, i: int, value: torch.Tensor) -> None:
        self.scores.setdefault(layer, [None] * self.num_seqs)[i] = value

    def put_step_scores(self, layer: int, value: torch.Tensor) -> None:
        """The decode kernel's probabilities of every sequence: `[S, num_heads, W]`."""
        self.step_scores[layer] = value

    def row_scores(self) -> dict[int, list[torch.Tensor | None]]:
        """`[layer][i]` -> `[num_heads, L_i]` where requested (None elsewhere): what
        `SparseMethod.after_step` receives. Rows of step_scores are views, valid for the
        step only (a method that keeps them must copy)."""
        out = {layer: list(rows) for layer, rows in self.scores.items()}
        for layer, dense in self.step_scores.items():
            rows = out.setdefault(layer, [None] * self.num_seqs)
            group = self.group_of_layer[layer]
            for i in range(self.num_seqs):
                if self.wants_scores(layer, i):
                    rows[i] = dense[i, :, : self.view_lens[group][i]]
        return out

    def dense_scores(self, layer: int) -> torch.Tensor:
        """`[S, num_heads, W]` probabilities at a score layer, zero past each row's view
        and for rows that did not ask (per-row scores are padded and stacked)."""
        if layer in self.step_scores:
            return self.step_scores[layer]
        rows = self.scores[layer]
        ref = next(r for r in rows if r is not None)
        width = max(r.shape[-1] for r in rows if r is not None)
        out = ref.new_zeros((self.num_seqs, ref.shape[0], width), dtype=torch.float32)
        for i, r in enumerate(rows):
            if r is not None:
                out[i, :, : r.shape[-1]] = r
        return out


# select_views(layer, q [S, num_heads, head_dim], batch) -> (subset [S, Hkv, B] int32,
# lens [S] int32) context positions each sequence's single query reads, or None for the
# whole views (the contract is SparseMethod.select_views).
SelectViews: TypeAlias = Callable[
    [int, torch.Tensor, ForwardBatch], tuple[torch.Tensor, torch.Tensor] | None
]


class AttentionBackend(abc.ABC):
    """Stores K/V into slots and computes causal attention over slot views."""

    name: str = "abstract"

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> None:
        # Per layer: [num_slots, num_kv_heads, head_dim]
        self.k_cache = k_cache
        self.v_cache = v_cache

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """`window` (sliding-window layers): a query at view entry p sees only the
        entries p - window < j <= p, i.e. itself and the window - 1 before it."""


# name -> "module:Class", imported lazily so CPU installs never import Triton.
_BACKENDS: dict[str, str] = {
    "torch": "sparsevllm.attention.torch_ref:TorchRefBackend",
    "triton": "sparsevllm.attention.triton_backend:TritonBackend",
}


def default_backend_name(device: torch.device) -> str:
    """Triton kernels on CUDA, the reference implementation elsewhere."""
    return "triton" if device.type == "cuda" else "torch"


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(_BACKENDS)})")
    module, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{_BACKENDS[name]} is not an AttentionBackend")
    return cls
