"""CUDA-graph capture of the decode step (model forward + logits) for batch buckets.

A decode step of a large model is hundreds of small kernel launches; replaying a
captured graph removes their launch gaps. Graphs are captured once per bucket size
over static input buffers; a step of S sequences replays the smallest bucket >= S
with the tail padded by dummy rows (no KV store: slot -1; a one-token view of slot 0).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.sparse_step import SparseStep

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from sparsevllm.engine.runner import ModelRunner

logger = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two up to 64, steps of 64 up to 1024, then of 256: few graphs, and a
    step pads at most 63 rows (255 above 1024)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_batch]
    sizes += list(range(128, min(max_batch, 1024) + 1, 64))
    sizes += list(range(1280, max_batch + 1, 256))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        self.buckets = bucket_sizes(max_batch)
        dev = runner.device
        groups = runner.pool.num_groups
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((groups, b), -1, dtype=torch.long, device=dev)
        self.rows = torch.zeros(b, dtype=torch.int32, device=dev)
        self.view_lens = torch.ones((groups, b), dtype=torch.int32, device=dev)
        self.decode = torch.ones(b, dtype=torch.bool, device=dev)  # replays are decode-only
        self.score_rows = torch.zeros(b, dtype=torch.int32, device=dev)
        self.method_ids = torch.full((b,), -1, dtype=torch.int32, device=dev)
        # The last table row is the padding row: its first entry points at slot 0.
        self.pad_row = runner.rows.num_rows - 1
        runner.rows.reserve(self.pad_row)
        runner.tables.table[:, self.pad_row, 0] = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.epoch: tuple[tuple[int, int], ...] = ()  # MethodSet.graph_epoch at capture
        # False while graph-view methods run on a backend that serves their views on the
        # host (AttentionBackend.graph_views_safe): decode steps are eager then.
        self.usable = True
        self.mem_pool: _POOL_HANDLE | None = None

    def _static_batch(self, size: int) -> ForwardBatch:
        r = self.runner
        groups = r.pool.num_groups
        # Decode rows' score requests (OmniKV's full layers): asked for every row, the
        # device copy says which rows really want them.
        want, score_layers = r.methods.graph_scores()
        width = r.tables.table.shape[2]
        batch = ForwardBatch(
            positions=self.positions[:size],
            q_starts=list(range(size)),
            q_lens=[1] * size,
            slot_mapping=self.slot_mapping[:, :size],
            tables=r.tables.table,
            rows=[self.pad_row] * size,
            # Host view lengths only size buffers here (e.g. decode probabilities): a
            # graph serves any view, so the full table width.
            view_lens=[[width] * size for _ in range(groups)],
            group_of_layer=r.pool.group_of_layer,
            logits_indices=torch.arange(size, device=r.device),
            backend=r.backend,
            rows_t=self.rows[:size],
            view_lens_t=self.view_lens[:, :size],
            q_starts_t=torch.arange(size + 1, dtype=torch.int32, device=r.device),
            sparse=SparseStep(
                score_rows=[want] * size,
                score_rows_t=self.score_rows[:size],
                decode_t=self.decode[:size],
                kv=r.kv,
                score_layers=score_layers,
                method_ids_t=self.method_ids[:size],
                shared_scores=r.methods.mixed,
                # Methods whose decode views are graph-safe compute them inside the graph.
                select_views=r.metered(r.methods.graph_views(self.method_ids[:size])),
                capturing=True,
            ),
        )
        # As before every eager step: the methods drop their previous step's results (a
        # warm-up run's must not be replayed by the captured graph).
        for method in r.methods.instances:
            method.begin_step(batch)
        return batch

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        model = r.model
        self.epoch = r.methods.graph_epoch
        self.graphs.clear()
        self.usable = r.backend.graph_views_safe or not r.methods.graph_methods()
        if not self.usable:
            logger.info("methods compute decode views the backend serves on the host: eager decode")
            return
        for method in r.methods.graph_methods():
            method.prepare_graph_capture(r.methods.kv_for(method), *r.tables.table.shape[1:])
        self.rows.fill_(self.pad_row)
        for size in reversed(self.buckets):  # largest first: smaller ones reuse its pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            # A fresh batch per forward, begun like an eager step's: a method's per-step
            # results (kept on the method, or scores on the batch) from a warm-up run
            # must not be reused by the captured one, or the graph would replay those
            # stale tensors.
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels outside the capture
                    model.compute_logits(model(self.ids[:size], self._static_batch(size)))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            batch = self._static_batch(size)
            with torch.cuda.graph(graph, pool=self.mem_pool):
                logits = model.compute_logits(model(self.ids[:size], batch))
            self.mem_pool = graph.pool()
            self.graphs[size] = (graph, logits)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def refresh(self) -> bool:
        """Capture again if a method reallocated device state its views read (or a
        graph-view method was added or dropped); whether the graphs serve decode now."""
        if self.epoch != self.runner.methods.graph_epoch:
            logger.info("sparse-method state was reallocated: capturing decode graphs again")
            self.mem_pool = None
            self.capture()
        return self.usable

    def run(self, batch: ForwardBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay for a pure-decode batch; returns logits `[S, vocab]`."""
        s = batch.num_seqs
        size = next(b for b in self.buckets if b >= s)
        self.ids[:s].copy_(input_ids)
        self.positions[:s].copy_(batch.positions)
        self.slot_mapping[:, :s].copy_(batch.slot_mapping)
        self.rows[:s].copy_(batch.rows_t)
        self.view_lens[:, :s].copy_(batch.view_lens_t)
        # A prompt's 1-token last chunk is not a decode row.
        self.decode[:s].copy_(batch.sparse.decode_t)
        self.score_rows[:s].copy_(batch.sparse.score_rows_t)
        if batch.sparse.method_ids_t is not None:
            self.method_ids[:s].copy_(batch.sparse.method_ids_t)
        if size > s:
            self.ids[s:size].zero_()
            self.positions[s:size].zero_()
            self.slot_mapping[:, s:size].fill_(-1)
            self.rows[s:size].fill_(self.pad_row)
            self.view_lens[:, s:size].fill_(1)
            self.decode[s:size].fill_(True)
            self.score_rows[s:size].zero_()
            self.method_ids[s:size].fill_(-1)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:s]
