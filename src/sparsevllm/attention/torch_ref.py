"""Reference attention backend: gather each sequence's view from the slots, then SDPA.

Runs on any device and every storage format (the storage quantizes on store and
dequantizes what a view reads); it is the CPU path and the oracle for the Triton kernels.
A chunk of more than one query reads the older view entries from storage and its own
keys and values as computed, as HF's quantized caches and KIVI attend a prefill to its
fresh K/V: a prompt prefilled in one chunk is exact in every format, and the format acts
on what later chunks and decode steps read. A single query (a decode step, or a chunk of
one token) reads its whole view, itself included, from storage, as the Triton decode
kernel does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsevllm.attention.backend import AttentionBackend, ForwardBatch
from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.attention.sparse_prefill import attend_block_sparse, estimate_reference
from sparsevllm.kv.format import KVStorage

# Padded view entries one batched decode read gathers at most (a 128K view, or four of
# 32K): a storage that decodes what it reads (DeltaKV's reconstruction, KIVI's
# dequantization) materializes float32 K/V for them, ~8 KB per entry at Llama-3-8B's
# KV heads, so a large decode batch reads in groups instead of all at once.
MAX_READ_TOKENS = 1 << 17


class TorchRefBackend(AttentionBackend):
    name = "torch"
    graph_safe = False  # host loops and host syncs per sequence

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        expansion: LatentExpansion | None = None,
    ) -> torch.Tensor:
        self.store_step(layer, q, k, v, batch, scale, window)
        return self.attend_stored(layer, q, k, v, batch, scale, window, expansion)

    def store_step(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, Dv]
        batch: ForwardBatch,
        scale: float,
        window: int | None,
    ) -> None:
        """Store the step's new K/V in the layer's own format and hand the method their
        queries: what every step does before attending, whichever path attends (a
        kernel backend's format adapters call it too)."""
        group = batch.group_of_layer[layer]
        self.storage[layer].store(k, v, batch.slot_mapping[group])
        if window is None:  # sparse methods leave sliding-window layers alone
            batch.sparse.hand_queries(layer, q, k, scale, batch.q_starts, batch.q_lens)

    def attend_stored(
        self,
        layer: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]: the new tokens' keys, stored already
        v: torch.Tensor,  # [T, Hkv, Dv]
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
        expansion: LatentExpansion | None = None,
        picked: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, Hq, Dv]
        """`forward` after the new tokens are stored and the method has their queries
        (a kernel backend hands the steps its kernels do not serve over to this).
        `picked`: the method's decode views for this step, when the caller asked for
        them already (`select_views` is not asked again)."""
        group = batch.group_of_layer[layer]
        storage = self.storage[layer]
        if picked is not None:
            picks: tuple[torch.Tensor, torch.Tensor] | None = (picked[0], picked[1].cpu())
        else:
            picks = _selection(layer, q, batch) if window is None else None
        if picks is None:
            whole = self.decode_whole_views(layer, q, batch, scale, window)
            if whole is not None:
                return whole if expansion is None else expansion.values(whole)
        out = q.new_empty(*q.shape[:2], v.shape[-1])  # [T, Hq, Dv] (MLA: Dv < D)
        expanded: list[tuple[int, int, torch.Tensor]] = []  # (start, n, [n, Hq, Dv_mla])
        for i, (start, n) in enumerate(zip(batch.q_starts, batch.q_lens)):
            view = batch.view(group, i)
            # Sparse methods leave sliding-window layers alone: no scores, no selection.
            rows = batch.sparse.wants_scores(layer, i) if window is None else 0
            if window is not None:
                # Nothing older than the first query's window is read: skip gathering it.
                view = view[-(n - 1 + window) :]
            q_i = q[start : start + n]
            selected = key_mask = None
            if picks is not None and n == 1:
                selected, key_mask = _row_selection(picks[0][i], picks[1][i])
            if selected is None:
                k_i, v_i = storage.read(view)
            else:
                k_i, v_i = gather_selected(storage, view, selected)
            if rows:
                if selected is not None:
                    raise RuntimeError("scores over a selected view are not supported")
                # Stored keys, as the Triton scores kernel reads them: a method ranks what
                # later steps will attend to.
                batch.sparse.put_scores(layer, i, attention_mass(q_i[-rows:], k_i, scale, window))
            if n > 1 and not storage.format.is_model_dtype:
                own = slice(start, start + n)  # the view's last n rows
                k_i = torch.cat([k_i[:-n], k[own].to(k_i.dtype)])
                v_i = torch.cat([v_i[:-n], v[own].to(v_i.dtype)])
            length = int(view.shape[0])
            if selected is None and expansion is not None and expansion.worth(n, length):
                expanded.append((start, n, expansion.attend(start, n, k_i, scale)))
                continue
            if selected is None and self.sparse_prefill_applies(layer, n, length, window):
                out[start : start + n] = self._attend_sparse(q_i, k_i, v_i, scale)
                continue
            out[start : start + n] = self.attend_chunk(q_i, k_i, v_i, scale, window, key_mask)
        return out if expansion is None else _up_projected(expansion, out, expanded)

    def attend_chunk(
        self,
        q: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [L, Hkv, D]: the view, the queries' own keys last
        v: torch.Tensor,  # [L, Hkv, Dv]
        scale: float,
        window: int | None,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:  # [n, Hq, Dv]
        """One sequence's queries over its (gathered) view: `attend`; a backend with a
        faster kernel for some chunks overrides it."""
        return attend(q, k, v, scale, window, key_mask)

    def decode_whole_views(
        self,
        layer: int,
        q: torch.Tensor,  # [S, Hq, D]
        batch: ForwardBatch,
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:  # [S, Hq, Dv]
        """Every sequence's single query over its whole view in one call, where that serves
        the step (no selection, no scores asked); None: the per-sequence loop. Here: one
        padded attention for two or more sequences."""
        if not _batched_decode(layer, batch, window):
            return None
        group = batch.group_of_layer[layer]
        return attend_decode_batch(q, self.storage[layer], batch, group, scale, window)

    def _attend_sparse(
        self,
        q: torch.Tensor,  # [n, Hq, D]
        k: torch.Tensor,  # [L, Hkv, D]
        v: torch.Tensor,  # [L, Hkv, Dv]
        scale: float,
    ) -> torch.Tensor:  # [n, Hq, Dv]
        """Block-sparse prefill of one chunk: estimate its pattern, attend under it."""
        cfg = self.prefill_sparsity
        assert cfg is not None
        count, index = estimate_reference(q, k, scale, cfg)
        return attend_block_sparse(q, k, v, scale, count, index, cfg.block_m, cfg.block_n)


def _up_projected(
    expansion: LatentExpansion,
    out: torch.Tensor,  # [T, Hq, R]: the absorbed rows' outputs (the expanded ones unset)
    expanded: list[tuple[int, int, torch.Tensor]],
) -> torch.Tensor:  # [T, Hq, Dv]
    """Every row's value: the absorbed rows through W_uv, the expanded chunks as they are
    (their unset absorbed rows are projected too, row by row, then overwritten)."""
    values = expansion.values(out)
    for start, n, chunk in expanded:
        values[start : start + n] = chunk
    return values


def whole_view_decode(layer: int, batch: ForwardBatch, window: int | None) -> bool:
    """Whether every sequence decodes one token over its whole view with no scores asked
    (the method's selection, if any, is asked separately)."""
    return batch.decode_only and (window is not None or not batch.asks_scores(layer))


def _batched_decode(layer: int, batch: ForwardBatch, window: int | None) -> bool:
    """Whether one padded attention serves every sequence's decode query (the
    per-sequence loop costs ~8 operators per sequence and layer, most of a CPU decode
    step's overhead at batch 16)."""
    return batch.num_seqs >= 2 and whole_view_decode(layer, batch, window)


def attend_decode_batch(
    q: torch.Tensor,
    storage: KVStorage,
    batch: ForwardBatch,
    group: int,
    scale: float,
    window: int | None,
    max_read_tokens: int = MAX_READ_TOKENS,
) -> torch.Tensor:
    """Single-query attention of every sequence over its view, padded to the longest:
    q `[S, Hq, D]` -> `[S, Hq, Dv]`. Table entries past a view's end are masked out.
    Sequences go in groups of at most `max_read_tokens` padded entries (at least one
    sequence), so the gathered (and, for a lossy format, decoded) K/V stays bounded."""
    slots, visible = batch.padded_views(group)  # [S, Lmax] each
    width = slots.shape[1]
    if window is not None:  # the query (entry L - 1) sees itself and window - 1 before it
        lens = visible.sum(dim=1, keepdim=True)  # [S, 1]
        cols = torch.arange(width, device=q.device)[None, :]
        visible = visible & (cols > lens - 1 - window)
    per_group = max(1, max_read_tokens // max(width, 1))
    outs = [
        _attend_padded(
            q[i : i + per_group],
            storage,
            slots[i : i + per_group],
            visible[i : i + per_group],
            scale,
        )
        for i in range(0, q.shape[0], per_group)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_padded(
    q: torch.Tensor,  # [S, Hq, D]
    storage: KVStorage,
    slots: torch.Tensor,  # [S, Lmax]
    visible: torch.Tensor,  # [S, Lmax] bool
    scale: float,
) -> torch.Tensor:  # [S, Hq, Dv]
    s, hq = q.shape[:2]
    width = slots.shape[1]
    k, v = storage.read(slots.reshape(-1))  # [S * Lmax, Hkv, D], [S * Lmax, Hkv, Dv]
    hkv = k.shape[1]
    kt = k.to(q.dtype).view(s, width, hkv, -1).transpose(1, 2)  # [S, Hkv, Lmax, D]
    vt = v.to(q.dtype).view(s, width, hkv, -1).transpose(1, 2)
    qf = q.view(s, hkv, hq // hkv, q.shape[-1])  # [S, Hkv, G, D]: GQA folded as in attend
    mask = visible[:, None, None, :]  # [S, 1, 1, Lmax]
    out = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=mask, scale=scale)
    return out.reshape(s, hq, -1)


def _selection(
    layer: int, q: torch.Tensor, batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The method's batched selection for the sequences with a single new query (their
    last query stands for all: rows with more queries ignore it); lens on the host."""
    select_views = batch.sparse.select_views
    if select_views is None or 1 not in batch.q_lens:
        return None
    last = [start + n - 1 for start, n in zip(batch.q_starts, batch.q_lens)]
    q_last = q[torch.tensor(last, device=q.device)]  # [S, Hq, D]
    picked = select_views(layer, q_last, batch)
    if picked is None:
        return None
    subset, lens = picked
    return subset, lens.cpu()


def _row_selection(
    subset: torch.Tensor, lens: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One row's picks: subset `[Hkv, B]` and its count (`[]`, or `[Hkv]` per KV head)
    -> (positions `[Hkv, B_i]` or None for the whole view, key mask `[Hkv, B_i + 1]` or
    None when every head reads all its B_i positions and the new token)."""
    if lens.dim() == 0 or bool((lens == lens[0]).all()):
        n = int(lens.reshape(-1)[0])
        return (None, None) if n < 0 else (subset[:, :n].long(), None)
    if bool((lens < 0).any()):
        raise ValueError("per-head subset counts must all be >= 0 (or the row's all -1)")
    width = int(lens.max())
    cols = torch.arange(width + 1)  # [B_i + 1]: the new token (last column) is always read
    mask = ((cols[None, :] < lens[:, None]) | (cols[None, :] == width)).to(subset.device)
    # Entries past a head's count are unspecified: read position 0 there (masked out).
    picks = torch.where(mask[:, :width], subset[:, :width], 0)  # [Hkv, B_i]
    return picks.long(), mask  # mask: [Hkv, B_i + 1], the new token always read


def gather_selected(
    storage: KVStorage, view: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the selected context positions plus the newest token (the view's last row).

    positions: `[B]` (all heads) or `[num_kv_heads, B]` (per head). Returns `[B + 1, Hkv, D]`.
    """
    last = view[-1:]
    if positions.dim() == 1:
        return storage.read(torch.cat([view[positions], last]))
    k_sel, v_sel = storage.read_heads(view[positions].t())  # [B, Hkv, D] each
    k_last, v_last = storage.read(last)
    return torch.cat([k_sel, k_last]), torch.cat([v_sel, v_last])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the last `n` view entries' queries over the whole view.

    q: [n, Hq, D]; k: [L, Hkv, D], v: [L, Hkv, Dv] with the queries' own keys as the
    last n rows; returns `[n, Hq, Dv]`.
    `window`: each query sees only itself and the `window - 1` view entries before it.
    `key_mask` `[Hkv, L]` (single query only): the keys each KV head may read.
    """
    n = q.shape[0]
    if window is not None:
        # Keys older than the first query's window are invisible to every query: drop them
        # so the work is O(n * (n + window)), not O(n * L).
        keep = min(k.shape[0], n - 1 + window)
        k, v = k[-keep:], v[-keep:]
    hq, hkv, d, dv = q.shape[1], k.shape[1], q.shape[2], v.shape[2]
    kt = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    vt = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
    if n == 1:
        # A single query sees every kept key, so the G query heads of a KV head can be
        # folded into the query axis: one [G, L] product per KV head, no GQA expansion.
        qf = q.reshape(hkv, hq // hkv, d).unsqueeze(0)  # [1, Hkv, G, D]
        mask = None if key_mask is None else key_mask[None, :, None, :]  # [1, Hkv, 1, L]
        out = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=mask, scale=scale)
        return out.reshape(1, hq, dv)
    if key_mask is not None:
        raise ValueError("a per-head key mask serves a single query")
    # A chunk with no older entries (a prompt's first chunk) is plain causal attention:
    # SDPA's causal kernel, without building and reading an [n, n] mask.
    causal = window is None and k.shape[0] == n
    mask = None if causal else causal_mask(n, k.shape[0], q.device, window)
    gqa = hq != hkv
    if gqa and hkv == 1 and q.is_cuda:
        # One KV head (MLA's latent rows, D 576): flash takes D <= 256 and the memory-
        # efficient kernel no enable_gqa, so SDPA would fall back to the math kernel and
        # hold [Hq, n, L] float32 probabilities (20 heads x 8K x 8K: 5 GiB). A stride-0
        # expansion over the query heads feeds the memory-efficient kernel, copying nothing.
        kt = kt.expand(-1, hq, -1, -1)  # [1, Hq, L, D]
        vt = vt.expand(-1, hq, -1, -1)
        gqa = False
    if gqa and mask is not None and q.is_cuda:
        # CUDA's memory-efficient kernel takes a mask but not enable_gqa, and the math
        # fallback would hold [Hq, n, L] probabilities (8.6 GB for a 2,048-token chunk
        # over a 32K view, 32 heads): expanding K and V to the query heads costs
        # 2 * Hq * L * D elements instead.
        kt = kt.repeat_interleave(hq // hkv, dim=1)  # [1, Hq, L, D]
        vt = vt.repeat_interleave(hq // hkv, dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]: 4-D inputs take SDPA's fast path
        kt,
        vt,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=gqa,
    )
    return out[0].transpose(0, 1)


def causal_mask(
    n: int, length: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """`[n, L]` True where query i (the view's entry L - n + i) may see key j.

    With `window` (HF's sliding-window rule, `q - window < kv <= q`), key j is also
    required to be among the query's last `window` entries, the query itself included.
    """
    rows = torch.arange(n, device=device).unsqueeze(1) + (length - n)  # [n, 1]
    cols = torch.arange(length, device=device).unsqueeze(0)  # [1, L]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def attention_mass(
    q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Softmax attention of the view's last `r` queries, summed over them: `[Hq, L]`.

    q: [r, Hq, D]; k: [L, Hkv, D]. Computed in float32. Keys outside a sliding
    `window` get zero mass.
    """
    r, hq, d = q.shape
    hkv = k.shape[1]
    # Query heads grouped under their KV head: the keys are read once per KV head, not
    # copied to every query head (a [32K, 32, 128] float32 copy is 512 MiB).
    qg = q.float().view(r, hkv, hq // hkv, d)  # [r, Hkv, G, D]
    logits = torch.einsum("rkgd,lkd->kgrl", qg, k.float()).reshape(hq, r, -1) * scale
    mask = causal_mask(r, k.shape[0], q.device, window)  # [r, L]
    logits = logits.masked_fill(~mask, float("-inf"))  # [Hq, r, L]
    return logits.softmax(dim=-1).sum(dim=1)
