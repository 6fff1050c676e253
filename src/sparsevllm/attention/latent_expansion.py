"""MLA prefill in the expanded form: latent rows up-projected to per-head keys and values.

A latent layer's cache holds one `[c_kv | k_pe]` row per token (R + P values). Decode
attends to the rows directly with absorbed queries (layers/mla.py): one KV head of
R + P dims, per query-key pair and head 2(R + P) + 2R FLOPs. A long prefill chunk can
instead up-project each row once per head,

    K_h = [W_uk_h c_kv, k_pe],  V_h = W_uv_h c_kv     (2 R H (Dn + Dv) FLOPs per row)

and attend with the un-absorbed queries `[q_nope, q_pe]`: 2(Dn + P) + 2 Dv FLOPs per
pair, at head dims SDPA's flash kernel takes (GLM-4.7-Flash: 256 against 576). The two
forms are equal (exactly, up to rounding): out_h = W_uv_h (sum_t p_t c_kv_t) = sum_t p_t V_h,t.

The up-projection is paid per key row, the saving per query pair; and at 576 dims SDPA
runs its memory-efficient kernel, at 256 its flash kernel. Measured on the H200 at
GLM-4.7-Flash's shapes (scripts/mla_prefill_check.py, docs/models.md), the expanded form
is faster for every chunk of at least `EXPANDED_QUERIES` queries (1.45x at 512 over
itself, 3.7x at 2,048 over 32K) and for chunks of 16 or more over views of at least
`EXPANDED_VIEW` rows (2.6x at 16 over 32K); only short first chunks (L = n <= 256, about
0.3 ms either way) are slower, by up to 11%. Chunks below `MIN_EXPANDED_QUERIES` were not
measured and stay absorbed. Off CUDA (not measured) the FLOP count decides. Its K and V (2 L H max(Dn + P, Dv) elements) are transient,
so views whose expansion would exceed `MAX_EXPANDED_BYTES` stay absorbed too.
Sparse methods see the same scores either way: observation scores,
queries and selections are computed in the absorbed form over the stored rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# The rule measured on the H200 (the module docstring): expanded from EXPANDED_QUERIES
# queries, or from MIN_EXPANDED_QUERIES over views of EXPANDED_VIEW rows.
MIN_EXPANDED_QUERIES = 16
EXPANDED_QUERIES = 512
EXPANDED_VIEW = 4096
# The largest transient expanded K + V of one view (a 32K view of GLM-4.7-Flash: 671 MB).
MAX_EXPANDED_BYTES = 2 * 2**30


@dataclass(frozen=True)
class LatentExpansion:
    """What a backend needs to serve a latent layer's prefill chunks expanded.

    Given to `AttentionBackend.forward`, it changes the output contract: every row's
    output is the value `[T, H, Dv]` (absorbed rows pass through `values`)."""

    q_nope: torch.Tensor  # [T, H, Dn]: the queries before absorption
    q_pe: torch.Tensor  # [T, H, P]: their rope part, rotated
    w_uk: torch.Tensor  # [H, Dn, R]
    w_uv: torch.Tensor  # [H, Dv, R]

    def values(self, o: torch.Tensor) -> torch.Tensor:  # [T, H, R] -> [T, H, Dv]
        return torch.einsum("thr,hvr->thv", o, self.w_uv)

    def worth(self, n: int, length: int) -> bool:
        """Whether a chunk of `n` queries over a view of `length` rows goes expanded."""
        heads, dn, rank = self.w_uk.shape
        qk, dv = dn + self.q_pe.shape[-1], self.w_uv.shape[1]  # Dn + P, Dv
        expanded_bytes = 2 * length * heads * max(qk, dv) * self.q_nope.element_size()
        if expanded_bytes > MAX_EXPANDED_BYTES or n < MIN_EXPANDED_QUERIES:
            return False
        if self.q_nope.is_cuda:
            return n >= EXPANDED_QUERIES or length >= EXPANDED_VIEW
        # Elsewhere (not measured) the FLOP count decides: causal query-key pairs at
        # each form's cost, plus the up-projection of every row.
        pairs = n * (length - n) + n * (n + 1) // 2
        absorbed = pairs * heads * (2 * (rank + qk - dn) + 2 * rank)
        expanded = length * 2 * rank * heads * (dn + dv) + pairs * heads * 2 * (qk + dv)
        return expanded < absorbed

    def attend(
        self,
        start: int,
        n: int,
        rows: torch.Tensor,  # [L, 1, R + P]: the view's latent rows, the chunk's last
        scale: float,
    ) -> torch.Tensor:  # [n, H, Dv]
        """Causal attention of the batch's queries `start:start + n` (the view's last n
        entries) over the view, in the expanded form."""
        rank = self.w_uk.shape[-1]
        # Joined per chunk, not per step: decode steps never need the plain queries.
        q = torch.cat([self.q_nope[start : start + n], self.q_pe[start : start + n]], dim=-1)
        rows = rows[:, 0].to(q.dtype)  # [L, R + P]
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]  # [L, R], [L, P]
        k_nope = torch.einsum("lr,hnr->hln", c_kv, self.w_uk)  # [H, L, Dn]
        heads, length = k_nope.shape[:2]
        k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(heads, -1, -1)], dim=-1)
        v = torch.einsum("lr,hvr->hlv", c_kv, self.w_uv)  # [H, L, Dv]
        # Bottom-right causal: query i is view entry L - n + i. SDPA dispatches it to the
        # flash kernel without materialising an [n, L] mask.
        mask = None if length == n else causal_lower_right(n, length)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, Dn + P]
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=length == n,
            scale=scale,
        )
        return out[0].transpose(0, 1)  # [n, H, Dv]
