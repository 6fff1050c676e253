"""Attention backends: prefill and decode attention over per-layer slot tables.

A backend owns nothing but references to the runner's per-layer KV storage (kv/: the
model dtype or a quantized format). Each call stores the new tokens' K/V into their
slots, then attends every new query to its sequence's view (the ordered slots it may
read, ending with the new tokens themselves).
"""

from __future__ import annotations

import abc
import importlib
import logging
from dataclasses import dataclass, field

import torch

from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.attention.sparse_prefill import PrefillSparsity
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.kv.format import KVFormat, KVStorage
from sparsevllm.kv.latent import LatentStorage
from sparsevllm.kv.layout import SlotLayout

logger = logging.getLogger(__name__)


@dataclass
class ForwardBatch:
    """The attention metadata of one model forward: what the kernels and a captured
    decode graph read, and the few host lists the backends loop over.

    Tokens of all scheduled sequences are flattened: sequence i owns query rows
    `q_starts[i] : q_starts[i] + q_lens[i]`. The sparse method's requests and results
    of the step are `sparse` (attention/sparse_step.py).
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
    sparse: SparseStep
    # single_query_rows, uploaded on first use in the step.
    _single_query_rows: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, init=False, repr=False
    )
    # padded_views per layer group, built on first use in the step.
    _padded_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False
    )
    # contiguous_starts per layer group, built on first use in the step.
    _contiguous_starts: dict[int, torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def decode_only(self) -> bool:
        """Every sequence has exactly one new query (the decode kernel's case)."""
        return all(n == 1 for n in self.q_lens)

    def asks_scores(self, layer: int) -> bool:
        """Whether the sparse method asks any sequence's attention probabilities in
        `layer` this step (then no kernel that returns only outputs serves it)."""
        return any(self.sparse.wants_scores(layer, i) for i in range(self.num_seqs))

    def max_view_len(self, group: int) -> int:
        return max(self.view_lens[group])

    def view(self, group: int, i: int) -> torch.Tensor:
        """Slot ids of sequence i's view in a layer group: `[L_i]` int64."""
        return self.tables[group, self.rows[i], : self.view_lens[group][i]].long()

    def single_query_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's last query row `[S]` and the sequences with a single new query
        `[R]`, on `device` (one upload per step, however many layers ask)."""
        if self._single_query_rows is None:
            last = [start + n - 1 for start, n in zip(self.q_starts, self.q_lens)]
            ones = [i for i, n in enumerate(self.q_lens) if n == 1]
            self._single_query_rows = (
                torch.tensor(last, device=device),
                torch.tensor(ones, device=device),
            )
        return self._single_query_rows

    def contiguous_starts(self, group: int) -> torch.Tensor:
        """Per sequence, the first slot of its view in a layer group when the view is one
        run of consecutive slots (position p in slot first + p), else -1: `[S]` int32,
        computed on the device without a host sync, once per step. With the default
        sequential slot order most prompts are one run, and kernels then address them
        without reading the slot table."""
        if group not in self._contiguous_starts:
            self._contiguous_starts[group] = contiguous_view_starts(
                self.tables[group], self.rows_t, self.view_lens_t[group], self.max_view_len(group)
            )
        return self._contiguous_starts[group]

    def padded_views(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's view in a layer group padded to the longest: slot ids
        `[S, Lmax]` (0 past a view's end) and where they are real `[S, Lmax]` bool. Built
        once per step: every layer of the group reads the same slots."""
        if group not in self._padded_views:
            device = self.tables.device
            lens = torch.tensor(self.view_lens[group], device=device)  # [S]
            cols = torch.arange(int(lens.max()), device=device)  # [Lmax]
            real = cols[None, :] < lens[:, None]  # [S, Lmax]
            slots = self.tables[group, self.rows_t, : cols.shape[0]].long()  # [S, Lmax]
            self._padded_views[group] = (torch.where(real, slots, 0), real)
        return self._padded_views[group]


def contiguous_view_starts(
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    rows: torch.Tensor,  # [S] int32
    view_lens: torch.Tensor,  # [S] int32
    max_view_len: int,
) -> torch.Tensor:
    """`[S]` int32: the first slot of each view that is one run of consecutive slots
    (position p in slot first + p), -1 for any other view; on the device, no host sync."""
    cols = torch.arange(max_view_len, device=table.device, dtype=torch.int32)  # [L]
    slots = table[rows.long(), :max_view_len]  # [S, L]
    first = slots[:, :1]  # [S, 1]
    real = cols[None, :] < view_lens[:, None]  # [S, L]
    off_run = (slots - first != cols[None, :]) & real
    return torch.where(off_run.any(dim=1), -1, first[:, 0]).to(torch.int32)


class AttentionBackend(abc.ABC):
    """Stores K/V into slots and computes causal attention over slot views."""

    name: str = "abstract"
    # Whether a decode step through this backend can be captured in a CUDA graph (a
    # backend may decide per instance, from the storage it serves).
    graph_safe: bool = True
    # Whether a captured decode step may also compute methods' selected views and scores
    # (DecodeViews.GRAPH methods): False where some layer serves those on the host.
    graph_views_safe: bool = True

    def __init__(
        self, storage: list[KVStorage], prefill_sparsity: PrefillSparsity | None = None
    ) -> None:
        self.storage = storage  # per layer
        # Block-sparse prefill (attention/sparse_prefill.py); None: every chunk dense.
        self.prefill_sparsity = prefill_sparsity

    def decode_captures(self, windowed: frozenset[int]) -> bool:
        """Whether a decode step over whole views can be captured in a CUDA graph, given
        the layers that attend through a sliding window."""
        return self.graph_safe

    def sparse_prefill_applies(
        self, layer: int, q_len: int, view_len: int, window: int | None
    ) -> bool:
        """Whether a chunk goes through block-sparse prefill: full-attention layers of
        per-head K/V in the model dtype only (quantized and KIVI formats, MLA's latent
        rows and sliding windows stay dense), chunks long enough to estimate from, views
        of at least min_len."""
        cfg = self.prefill_sparsity
        storage = self.storage[layer]
        if cfg is None or window is not None or isinstance(storage, LatentStorage):
            return False
        return storage.format.is_model_dtype and cfg.applies(q_len, view_len)

    @classmethod
    def serves(cls, layout: SlotLayout, fmt: KVFormat) -> bool:
        """Whether the backend's kernels read storage of this slot layout in `fmt`."""
        return True

    @abc.abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, value_dim]
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        expansion: LatentExpansion | None = None,
    ) -> torch.Tensor:  # [T, num_heads, value_dim]
        """`window` (sliding-window layers): a query at view entry p sees only the
        entries p - window < j <= p, i.e. itself and the window - 1 before it.

        `value_dim` is `head_dim` except in a shared-KV layout (MLA), where `v` is the
        first `value_dim` entries of `k` (kv/layout.py). A latent layer that passes its
        `expansion` gets every row's output up-projected to `[T, num_heads, Dv]`
        instead, and chunks the expansion is worth for attend in the expanded form
        (attention/latent_expansion.py)."""


# name -> "module:Class", imported lazily so CPU installs never import Triton.
_BACKENDS: dict[str, str] = {
    "torch": "sparsevllm.attention.torch_ref:TorchRefBackend",
    "triton": "sparsevllm.attention.triton_backend:TritonBackend",
    "cpu": "sparsevllm.attention.cpu_backend:CPUBackend",
}


def default_backend_name(device: torch.device) -> str:
    """Triton kernels on CUDA, the CPU backend (the reference with a native decode
    kernel) on the CPU, the reference implementation elsewhere."""
    if device.type == "cuda":
        return "triton"
    return "cpu" if device.type == "cpu" else "torch"


def resolve_backend_name(name: str, device: torch.device) -> str:
    """An explicitly chosen `attention_backend` on `device`: one whose kernels cannot run
    there is refused, naming those that can."""
    runs_on = {"triton": "cuda", "cpu": "cpu"}.get(name)
    if runs_on is not None and device.type != runs_on:
        usable = [n for n, d in (("triton", "cuda"), ("cpu", "cpu")) if d == device.type]
        raise ValueError(
            f"attention_backend {name!r} runs on {runs_on} devices, not {device.type}; "
            f"on {device.type} use {', '.join(['auto', *usable, 'torch'])}"
        )
    return name


def backend_for(name: str, layout: SlotLayout, fmt: KVFormat) -> type[AttentionBackend]:
    """Backend `name`, or the torch reference when its kernels do not read `layout` in
    `fmt` (the reference reads every layout and format, on every device)."""
    cls = get_backend_class(name)
    if cls.serves(layout, fmt):
        return cls
    logger.warning(
        "the %s attention backend has no kernels for the %s slot layout in kv_cache_dtype "
        "%s: using the torch reference backend (eager, no CUDA graphs)",
        name,
        layout.name,
        fmt.name,
    )
    return get_backend_class("torch")


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(_BACKENDS)})")
    module, cls_name = _BACKENDS[name].split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"{_BACKENDS[name]} is not an AttentionBackend")
    return cls
