"""CUDA attention backend: Triton kernels that read K/V through the slot tables.

Pure decode batches use the split-K decode kernel (capturable in a CUDA graph);
batches with prefill chunks use the varlen prefill kernel. Sparse-method requests
are served here too: decode scores come from the decode kernel's probability output,
logical views come batched from the method as a per-KV-head index subset (also for the
decoding rows of a batch with prefill chunks); prefill observation scores (once per
prefill) are computed per KV head through the slot table (`window_attention_mass`).
Sliding-window layers pass their window to both kernels; sparse methods leave them
alone (no logical views, no scores). A quantized storage format (kv/scaled.py) hands the
kernels its per-token scales: they quantize on store and dequantize in registers. KIVI
layers (kv/kivi.py) go to attention/triton_kivi.py, DeltaKV layers (kv/deltakv.py) to
attention/triton_deltakv.py (their whole-view decode steps capture; the method
compresses on the host between them).

MLA's latent layout (kv/latent.py, one `[c_kv | k_pe]` row per token whose value is its
c_kv prefix): the new rows are written by `store_rows` (one buffer), and pure decode
batches run `decode_mla_attention` over the rows (heads packed per key tile; the same
subset and scores hooks, so every served method runs on it, in a CUDA graph). Batches
with prefill chunks go to the torch reference's attention over the stored rows (SDPA per
sequence; long chunks in the expanded form, attention/latent_expansion.py): the reference also
serves those batches' decoding rows with the method's selection and scores.
"""

from __future__ import annotations

import torch

from sparsevllm.attention.backend import AttentionBackend, ForwardBatch
from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.attention.sparse_prefill import PrefillSparsity, select_blocks
from sparsevllm.attention.torch_ref import TorchRefBackend
from sparsevllm.attention.triton import (
    decode_attention,
    decode_mla_attention,
    prefill_attention,
    store_kv,
    store_rows,
    window_attention_mass,
)
from sparsevllm.attention.triton.deltakv_tiles import head_dim_readable
from sparsevllm.attention.triton.prefill_sparse import block_mass, prefill_sparse_attention
from sparsevllm.attention.triton_deltakv import DeltaKVAttention
from sparsevllm.attention.triton_kivi import KiviAttention
from sparsevllm.kv.format import KVFormat, KVStorage
from sparsevllm.kv.latent import LatentStorage
from sparsevllm.kv.layout import SlotLayout


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self, storage: list[KVStorage], prefill_sparsity: PrefillSparsity | None = None
    ) -> None:
        super().__init__(storage, prefill_sparsity)
        self.kivi = KiviAttention(storage)
        self.deltakv = DeltaKVAttention(storage)
        # Latent layers' prefill chunks (and sliding windows, which MLA models have not).
        self.reference = TorchRefBackend(storage)
        # KIVI and DeltaKV layers serve selected views and scores through the torch
        # reference, which waits for the host; their whole-view decode steps (kernel
        # and store) capture (KiviAttention and DeltaKVAttention.decode_captures).
        self.graph_views_safe = not any(s.format.kernels in ("kivi", "deltakv") for s in storage)

    def decode_captures(self, windowed: frozenset[int]) -> bool:
        return self.kivi.decode_captures(windowed) and self.deltakv.decode_captures()

    @classmethod
    def serves(cls, layout: SlotLayout, fmt: KVFormat) -> bool:
        # Separate K and V buffers of one head_dim: elements with at most a per-token
        # scale, KIVI's packed codes, or DeltaKV's latents and full rows (heads the
        # DeltaKV kernel reads; a layer whose latent it cannot read goes to the
        # reference). A shared-KV (MLA latent) buffer: elements with at most a per-row
        # scale (the model dtype, bf16 / fp16, int8, fp8_e4m3).
        if layout.shared_kv:
            return fmt.kernels == "elementwise"
        if fmt.kernels == "deltakv":
            return head_dim_readable(layout.head_dim)
        return fmt.kernels in ("elementwise", "kivi")

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        expansion: LatentExpansion | None = None,
    ) -> torch.Tensor:
        group = batch.group_of_layer[layer]
        storage = self.storage[layer]
        if storage.format.kernels == "kivi":
            return self.kivi.forward(layer, q, k, v, batch, scale, window)
        if storage.format.kernels == "deltakv":
            return self.deltakv.forward(layer, q, k, v, batch, scale, window)
        if _is_latent(storage):
            return self._latent_forward(layer, q, k, v, batch, scale, window, expansion)
        # Scales (None for the model dtype): the kernels quantize and dequantize with them.
        k_scale, v_scale = storage.k_scale, storage.v_scale
        store_kv(k, v, storage.k, storage.v, batch.slot_mapping[group], k_scale, v_scale)
        if window is None:  # sparse methods leave sliding-window layers alone
            batch.sparse.hand_queries(layer, q, k, scale, batch.q_starts, batch.q_lens)
        out = torch.empty_like(q)
        table = batch.tables[group]
        if batch.decode_only:
            return self._decode(layer, q, batch, scale, out, window)
        self._prefill(layer, q, k, v, batch, scale, out, window)
        if window is None and batch.sparse.select_views is not None and 1 in batch.q_lens:
            self._single_query_views(layer, q, batch, scale, out)
        for i in range(batch.num_seqs if window is None else 0):
            rows = batch.sparse.wants_scores(layer, i)
            if rows:
                start, n = batch.q_starts[i], batch.q_lens[i]
                q_i = q[start : start + n][-rows:]
                # Through the slot table, one KV head at a time: no gathered fp32 copy of
                # the view's keys for every query head (512 MiB at 32K tokens).
                view_slots = table[batch.rows[i]]
                mass = window_attention_mass(
                    q_i, storage, view_slots, batch.view_lens[group][i], scale
                )
                batch.sparse.put_scores(layer, i, mass)
        return out

    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D]
        window: int | None,
    ) -> None:
        """Prefill attention of a batch with chunks: the chunks sparse prefill applies to
        go through estimation and the block-sparse kernel one by one, the other
        sequences through one dense launch (the whole batch when none goes sparse)."""
        view_lens = batch.view_lens[batch.group_of_layer[layer]]
        chosen = [
            i
            for i in range(batch.num_seqs)
            if self.sparse_prefill_applies(layer, batch.q_lens[i], view_lens[i], window)
        ]
        if not chosen:
            self._dense_prefill(layer, q, k, v, batch, scale, out, window, None)
            return
        dense = [i for i in range(batch.num_seqs) if i not in chosen]
        if dense:
            self._dense_prefill(layer, q, k, v, batch, scale, out, window, dense)
        for i in chosen:
            self._sparse_prefill(layer, q, batch, scale, out, i)

    def _dense_prefill(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D]
        window: int | None,
        seqs: list[int] | None,
    ) -> None:
        """The dense prefill kernel over the batch, or over the sequences `seqs` only (the
        others go sparse): their query rows are gathered, attended and scattered back."""
        group = batch.group_of_layer[layer]
        storage = self.storage[layer]
        rows, q_starts, lens = batch.rows_t, batch.q_starts_t, batch.view_lens_t[group]
        run_starts = batch.contiguous_starts(group)
        q_lens = batch.q_lens
        token_rows = None
        if seqs is not None:
            q_lens = [batch.q_lens[i] for i in seqs]
            spans = [range(batch.q_starts[i], batch.q_starts[i] + batch.q_lens[i]) for i in seqs]
            token_rows = torch.tensor([t for span in spans for t in span], device=q.device)
            picked = torch.tensor(seqs, device=q.device)
            rows, lens, run_starts = rows[picked], lens[picked], run_starts[picked]
            starts = [0] + q_lens
            q_starts = torch.tensor(starts, device=q.device).cumsum(0).to(torch.int32)
            q, k, v = q[token_rows], k[token_rows], v[token_rows]
        res = out if token_rows is None else torch.empty_like(q)
        k_scale, v_scale = storage.k_scale, storage.v_scale
        prefill_attention(
            q,
            storage.k,
            storage.v,
            batch.tables[group],
            rows,
            q_starts,
            lens,
            scale,
            res,
            max_q_len=max(q_lens),
            window=window,
            k_scale=k_scale,
            v_scale=v_scale,
            k_new=None if k_scale is None else k,
            v_new=None if k_scale is None else v,
            contig_starts=run_starts,
        )
        if token_rows is not None:
            out[token_rows] = res

    def _sparse_prefill(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D]
        i: int,
    ) -> None:
        """Sequence i's chunk: estimate its block pattern from its last queries, then run
        the block-sparse kernel over it (writing its rows of `out`)."""
        cfg = self.prefill_sparsity
        assert cfg is not None
        group = batch.group_of_layer[layer]
        storage = self.storage[layer]
        start, n = batch.q_starts[i], batch.q_lens[i]
        length = batch.view_lens[group][i]
        table_row = batch.tables[group, batch.rows[i]]  # [max_len] the view's slots
        q_i = q[start : start + n]  # [n, Hq, D]
        mass = block_mass(q_i[-cfg.last_q :], storage.k, table_row, length, scale, cfg.block_n)
        count, index = select_blocks(mass, n, length, cfg)
        prefill_sparse_attention(
            q_i,
            storage.k,
            storage.v,
            table_row,
            length,
            scale,
            count,
            index,
            out[start : start + n],
            block_m=cfg.block_m,
            block_n=cfg.block_n,
        )

    def _latent_forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, R + P] absorbed queries
        k: torch.Tensor,  # [T, 1, R + P] the new latent rows
        v: torch.Tensor,  # [T, 1, R]: their prefix, not written separately
        batch: ForwardBatch,
        scale: float,
        window: int | None,
        expansion: LatentExpansion | None,
    ) -> torch.Tensor:  # [T, H, R], or [T, H, Dv] with an expansion
        """A latent layer: store the rows; decode batches through the MLA kernel, batches
        with prefill chunks (and a window, which no MLA model has) through the reference
        attention over the stored rows, which also applies the method's views and scores
        and attends long chunks in the expanded form (flash SDPA at 256 dims)."""
        storage = self.storage[layer]
        store_rows(k, storage.k, batch.slot_mapping[batch.group_of_layer[layer]], storage.k_scale)
        if window is None:
            batch.sparse.hand_queries(layer, q, k, scale, batch.q_starts, batch.q_lens)
        if window is not None or not batch.decode_only:
            return self.reference.attend_stored(layer, q, k, v, batch, scale, window, expansion)
        out = q.new_empty(*q.shape[:2], v.shape[-1])  # [S, H, R]
        out = self._decode(layer, q, batch, scale, out, window)
        return out if expansion is None else expansion.values(out)

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,  # [S, Hq, D]: one query per sequence
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """Split-K decode over each view, a method's batched subset, and the attention
        probabilities the methods asked for (sliding layers: their window only)."""
        group = batch.group_of_layer[layer]
        table = batch.tables[group]
        subset = subset_lens = None
        want = [0] * batch.num_seqs
        if window is None:
            select_views = batch.sparse.select_views
            if select_views is not None:
                # One batched call per layer: [S, Hkv, B] positions, [S] or [S, Hkv] counts.
                subset, subset_lens = select_views(layer, q, batch) or (None, None)
            want = [batch.sparse.wants_scores(layer, i) for i in range(batch.num_seqs)]
        scores = None
        if any(want):
            # Probabilities over the table width [S, Hq, width]: narrow the table to the
            # batch's longest view so the buffer is not sized by max_model_len.
            table = table[:, : batch.max_view_len(group)]
            scores = torch.empty(
                (q.shape[0], q.shape[1], table.shape[-1]), dtype=torch.float32, device=q.device
            )
        storage = self.storage[layer]
        if _is_latent(storage):
            decode_mla_attention(
                q,
                storage.k,
                table,
                batch.rows_t,
                batch.view_lens_t[group],
                scale,
                out,
                subset=subset,
                subset_lens=subset_lens,
                scores_out=scores,
                kv_scale=storage.k_scale,
            )
        else:
            decode_attention(
                q,
                storage.k,
                storage.v,
                table,
                batch.rows_t,
                batch.view_lens_t[group],
                scale,
                out,
                subset=subset,
                subset_lens=subset_lens,
                scores_out=scores,
                window=window,
                k_scale=storage.k_scale,
                v_scale=storage.v_scale,
            )
        if scores is not None:
            self._keep_scores(layer, scores, want, batch)
        return out

    def _single_query_views(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        batch: ForwardBatch,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D], the prefill kernel's (dense) result
    ) -> None:
        """In a batch with prefill chunks, the sequences with a single new query (decoding
        ones) read the method's view, as in a decode-only step: the decode kernel
        recomputes their rows over the subset and overwrites the dense result."""
        select_views = batch.sparse.select_views
        if select_views is None:
            return
        last_t, ones_t = batch.single_query_rows(q.device)  # [S], [R]
        q_last = q[last_t]  # [S, Hq, D]
        picked = select_views(layer, q_last, batch)
        if picked is None:
            return
        subset, lens = picked  # [S, Hkv, B], [S] or [S, Hkv] (-1: the whole view)
        group = batch.group_of_layer[layer]
        q_one = q_last[ones_t]  # [R, Hq, D]
        res = torch.empty_like(q_one)
        storage = self.storage[layer]
        decode_attention(
            q_one,
            storage.k,
            storage.v,
            batch.tables[group],
            batch.rows_t[ones_t],
            batch.view_lens_t[group][ones_t],
            scale,
            res,
            subset=subset[ones_t],
            subset_lens=lens[ones_t],
            k_scale=storage.k_scale,
            v_scale=storage.v_scale,
        )
        out[last_t[ones_t]] = res

    @staticmethod
    def _keep_scores(
        layer: int, scores: torch.Tensor, want: list[int], batch: ForwardBatch
    ) -> None:
        """Keep a decode step's `[S, Hq, W]` probabilities for the methods. When most rows
        asked (OmniKV, H2O, TOVA), the buffer is kept whole for the step (read batched or
        as row views); when few did (a prompt ending in a decode batch), only their rows
        are copied, so a large batch does not hold one whole buffer per layer."""
        group = batch.group_of_layer[layer]
        if 2 * sum(1 for w in want if w) >= len(want):
            batch.sparse.put_step_scores(layer, scores, batch.view_lens[group])
            return
        for i, w in enumerate(want):
            if w:
                view = scores[i, :, : batch.view_lens[group][i]]
                batch.sparse.put_scores(layer, i, view.clone())


def _is_latent(storage: KVStorage) -> bool:
    """A shared-KV storage (kv/latent.py): V is a view of K's rows (MLA's latent)."""
    return isinstance(storage, LatentStorage)
