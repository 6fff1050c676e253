"""Score helpers for sparse methods, in plain torch (they run once per prefill end or
once per Quest page refresh, so clarity beats a custom kernel here).

* `window_attention_mass`: summed softmax of the view's last r queries (an observation
  window, causal inside it), as torch_ref.attention_mass but reading K through slots
  and one KV head at a time so the fp32 logits stay [G, r, L] instead of [Hq, r, L].
* `quest_page_minmax` / `quest_page_scores`: Quest's per-page key bounds and the
  query's upper bound on q.k per page, as sparse/quest.py.
"""

from __future__ import annotations

import torch

from sparsevllm.kv.format import KVStorage


def window_attention_mass(
    q_rows: torch.Tensor,  # [r, Hq, D] the view's last r queries
    storage: KVStorage,  # the layer's KV (keys are read dequantized)
    view_slots: torch.Tensor,  # [>= view_len] slot ids of the view (e.g. table[row])
    view_len: int,
    scale: float,
) -> torch.Tensor:  # [Hq, view_len] float32
    """Softmax probabilities of the r window queries over the view, summed over queries.

    Query i is the view's entry view_len - r + i and sees positions <= that entry.
    """
    r, num_q_heads, head_dim = q_rows.shape
    num_kv_heads = storage.num_kv_heads
    group = num_q_heads // num_kv_heads
    slots = view_slots[:view_len].long()  # [L]
    device = q_rows.device
    rows = torch.arange(r, device=device).unsqueeze(1) + (view_len - r)  # [r, 1]
    hidden = torch.arange(view_len, device=device).unsqueeze(0) > rows  # [r, L] future keys
    out = torch.empty((num_q_heads, view_len), dtype=torch.float32, device=device)
    for h in range(num_kv_heads):
        keys = storage.read_head_keys(slots, h).float()  # [L, D]
        qh = q_rows[:, h * group : (h + 1) * group].float()  # [r, G, D]
        logits = torch.einsum("rgd,ld->grl", qh, keys) * scale  # [G, r, L]
        logits.masked_fill_(hidden, float("-inf"))
        out[h * group : (h + 1) * group] = logits.softmax(dim=-1).sum(dim=1)
    return out


def quest_page_minmax(
    storage: KVStorage,  # the layer's KV (keys are read dequantized)
    table: torch.Tensor,  # [num_rows, max_len] int32 slot ids
    row: int,
    start_page: int,
    end_page: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [P, Hkv, D] float32
    """Element-wise min and max of the keys of view pages [start_page, end_page).

    Page p covers view positions [p * page_size, (p + 1) * page_size); all must be full.
    """
    num_pages = end_page - start_page
    num_kv_heads, head_dim = storage.num_kv_heads, storage.head_dim
    if num_pages <= 0:
        empty = torch.empty((0, num_kv_heads, head_dim), dtype=torch.float32, device=storage.device)
        return empty, empty.clone()
    slots = table[row, start_page * page_size : end_page * page_size].long()  # [P * size]
    keys = storage.read_keys(slots).float().view(num_pages, page_size, num_kv_heads, head_dim)
    return keys.amin(dim=1), keys.amax(dim=1)


def quest_page_scores(
    q: torch.Tensor,  # [Hq, D]
    pmin: torch.Tensor,  # [P, Hkv, D]
    pmax: torch.Tensor,  # [P, Hkv, D]
    num_kv_heads: int,
) -> torch.Tensor:  # [Hkv, P] float32
    """Upper bound of q.k per page, summed over each KV head's query heads.

    max(q_d * lo_d, q_d * hi_d) = relu(q_d) * hi_d + min(q_d, 0) * lo_d because lo <= hi,
    and that is linear in q: the G heads' positive and negative parts are summed first,
    so the [Hkv, G, P, D] product of the direct formula shrinks to [P, Hkv, D].
    """
    num_q_heads, head_dim = q.shape
    qg = q.float().view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [Hkv, G, D]
    q_pos = qg.clamp(min=0).sum(dim=1)  # [Hkv, D]
    q_neg = qg.clamp(max=0).sum(dim=1)  # [Hkv, D]
    bound = (pmax.float() * q_pos).sum(dim=-1) + (pmin.float() * q_neg).sum(dim=-1)  # [P, Hkv]
    return bound.t().contiguous()
