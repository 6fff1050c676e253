"""Reference attention backend: gather each sequence's view from the slots, then SDPA.

Runs on any device; it is the CPU path and the oracle for the Triton kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsevllm.attention.backend import AttentionBackend, ForwardBatch


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        group = batch.group_of_layer[layer]
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        slots = batch.slot_mapping[group]
        k_cache[slots] = k.to(k_cache.dtype)
        v_cache[slots] = v.to(v_cache.dtype)
        out = torch.empty_like(q)
        for i, (start, n) in enumerate(zip(batch.q_starts, batch.q_lens)):
            view = batch.views[group][i]
            out[start : start + n] = attend(
                q[start : start + n], k_cache[view], v_cache[view], scale
            )
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of the last `n` view entries' queries over the whole view.

    q: [n, Hq, D]; k, v: [L, Hkv, D] with the queries' own keys as the last n rows.
    """
    n, length = q.shape[0], k.shape[0]
    mask = None
    if n > 1:
        rows = torch.arange(n, device=q.device).unsqueeze(1) + (length - n)
        mask = torch.arange(length, device=q.device).unsqueeze(0) <= rows  # [n, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.to(q.dtype).transpose(0, 1),
        v.to(q.dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
