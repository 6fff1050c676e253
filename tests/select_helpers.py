"""Shared by the batched-selection tests (CPU and CUDA): a slot-based KVAccess, a
one-query-per-row ForwardBatch builder and the row check against `select_view`."""

from __future__ import annotations

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.sparse_step import SparseStep
from sparsevllm.sparse.base import HeadRanks, SeqStep

HQ, HKV, D = 8, 2, 16
NO_SINK = {"sink_keep_tokens": 0, "recent_keep_tokens": 0}


class SlotKV:
    """KVAccess over per-layer slot tensors and per-sequence slot lists (one group)."""

    def __init__(self, num_layers: int, num_slots: int, seed: int, device="cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_layers, self.num_kv_heads, self.num_slots = num_layers, HKV, num_slots
        self.device = torch.device(device)
        self.k = [
            torch.randn(num_slots, HKV, D, generator=g).to(self.device) for _ in range(num_layers)
        ]
        self.free = torch.randperm(num_slots, generator=g).tolist()
        self.views: dict[int, list[int]] = {}

    def grow(self, seq: int, n: int = 1, prefix: list[int] | None = None) -> None:
        view = self.views.setdefault(seq, list(prefix or []))
        view.extend(self.free.pop() for _ in range(n))

    def resident(self, seq: int, layer: int) -> int:
        return len(self.views[seq])

    def view_slots(self, seq: int, layer: int, start: int = 0, end: int | None = None):
        return self.views[seq][start:end]

    def keys(self, seq: int, layer: int, start: int = 0, end: int | None = None):
        slots = torch.tensor(self.views[seq][start:end], dtype=torch.long, device=self.device)
        return self.k[layer][slots]

    def gather_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.k[layer][slots]

    def head_ranks(self) -> HeadRanks:
        return HeadRanks(0, HKV, HKV)  # one rank


def make_batch(
    kv: SlotKV,
    rows: list[tuple[int, int, bool]],
    num_rows: int = 8,
    max_len=128,
    capturing: bool = False,
):
    """A one-query-per-row ForwardBatch: (seq_id, table row, is_decode) per sequence; the
    view is kv.views[seq] (its last entry is the new token). `capturing`: the batch of a
    decode-graph capture, whose host lists describe no real step."""
    lens = [len(kv.views[s]) for s, _, _ in rows]
    table = torch.full((1, num_rows, max_len), -1, dtype=torch.int32)
    steps = []
    for i, ((seq, row, decode), n) in enumerate(zip(rows, lens)):
        table[0, row, :n] = torch.tensor(kv.views[seq], dtype=torch.int32)
        steps.append(SeqStep(seq, i, n - 1, 1, n - 1 if decode else n))
    s, dev = len(rows), kv.device
    flags = [int(d) for _, _, d in rows]
    return ForwardBatch(
        positions=torch.tensor([n - 1 for n in lens], device=dev),
        q_starts=list(range(s)),
        q_lens=[1] * s,
        slot_mapping=torch.zeros(1, s, dtype=torch.long, device=dev),
        tables=table.to(dev),
        rows=[r for _, r, _ in rows],
        view_lens=[lens],
        group_of_layer=[0] * kv.num_layers,
        logits_indices=torch.arange(s, device=dev),
        backend=None,
        rows_t=torch.tensor([r for _, r, _ in rows], dtype=torch.int32, device=dev),
        view_lens_t=torch.tensor([lens], dtype=torch.int32, device=dev),
        q_starts_t=torch.arange(s + 1, dtype=torch.int32, device=dev),
        sparse=SparseStep(
            score_rows=flags,
            score_rows_t=torch.tensor(flags, dtype=torch.int32, device=dev),
            decode_t=torch.tensor(flags, dtype=torch.bool, device=dev),
            kv=kv,
            steps=steps,
            capturing=capturing,
        ),
    )


def check_row(subset, lens, i, ref, context):
    """Row i of a batched selection reads exactly what select_view's `ref` says."""
    n = int(lens[i])
    if ref is None:  # whole view: either lens -1 or the context in order
        assert n == -1 or subset[i, :, :n].tolist() == [list(range(context))] * HKV
        return
    ref = ref.expand(HKV, -1) if ref.dim() == 1 else ref
    assert subset[i, :, :n].tolist() == ref.tolist()
