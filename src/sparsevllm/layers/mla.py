"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash), HF parameter names.

Following transformers' `DeepseekV3Attention`:

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) without q_lora_rank)
             per head [q_nope (qk_nope_head_dim), q_pe (qk_rope_head_dim)]
    c_kv, k_pe = kv_a_proj_with_mqa(x);  c_kv = kv_a_layernorm(c_kv)
    per head k = [W_uk c_kv, k_pe], v = W_uv c_kv  (kv_b_proj = [W_uk; W_uv] per head)

RoPE acts on q_pe and the single shared k_pe only (interleaved pairs when
`rope_interleave`: the even then the odd channels, rotated as rotate-half, which is how
transformers computes it). The softmax scale is (qk_nope + qk_rope)^-0.5 times YaRN's
mscale(factor, mscale_all_dim)^2 when the rope is scaled.

The KV cache holds one latent row per token, `[c_kv, k_pe]` (kv/layout.py): the query
is absorbed through W_uk, so that attention is one-KV-head attention over the rows,

    scores_h = [q_nope_h W_uk_h, q_pe_h] . [c_kv, k_pe]   (= q_h . k_h, exactly)
    out_h    = W_uv_h (sum_t p_t c_kv_t)                  (= sum_t p_t v_h,t)

and the attention backend sees a query `[T, Hq, R + P]`, a key row `[T, 1, R + P]`
and its first R entries as the value. What sparse methods see (one KV head whose keys
are the latent rows; per query head attention probabilities, the true ones) is this
form in every step. Long prefill chunks attend in the equal expanded form (rows
up-projected per head: attention/latent_expansion.py), which the backend picks per
chunk from the chunk's length and view.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsevllm.attention.backend import ForwardBatch
from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.kv.layout import SlotLayout, latent_layout
from sparsevllm.layers.linear import Projections
from sparsevllm.layers.norm import RMSNorm
from sparsevllm.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not
# the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_layout(config: Any) -> SlotLayout:
    return latent_layout(config.kv_lora_rank, config.qk_rope_head_dim)


def mla_softmax_scale(config: Any) -> float:
    scale: float = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(float(params["factor"]), float(mscale_all_dim)) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`[..., P]` channel pairs (x0, x1), (x2, x3)... -> the rotate-half layout
    [x0, x2, ..., x1, x3, ...]."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.rank, self.rope = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        h, heads, qk = config.hidden_size, self.num_heads, self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
            q_in = self.q_proj
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk, bias=False)
            q_in = self.q_a_proj
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias)
        self.scale = mla_softmax_scale(config)
        self.interleaved = bool(getattr(config, "rope_interleave", False))
        # Both read x: one GEMM once fused (only when both or neither have a bias).
        same_bias = (q_in.bias is None) == (self.kv_a_proj_with_mqa.bias is None)
        self.in_proj = Projections(q_in, self.kv_a_proj_with_mqa) if same_bias else None

    def forward(
        self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        t = x.shape[0]  # x: [T, hidden]
        q, (q_nope, q_pe), latent = self._queries_and_latent(x, rotary, batch.positions)
        v = latent[..., : self.rank]  # [T, 1, R]: the value is the row's c_kv part
        # The backend attends decode rows absorbed and long prefill chunks expanded, and
        # returns every row's value through W_uv.
        expansion = LatentExpansion(q_nope, q_pe, *self._kv_b_heads())
        o = batch.backend.forward(
            self.layer_idx, q, latent, v, batch, self.scale, expansion=expansion
        )  # [T, H, Dv]
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def _queries_and_latent(
        self, x: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Absorbed queries `[T, H, R + P]`, the queries they absorb (`[T, H, Dn]` and
        the rotated `[T, H, P]`) and latent rows `[T, 1, R + P]`."""
        t = x.shape[0]
        if self.in_proj is not None:
            q, kv = self.in_proj(x)  # [T, q_lora_rank or H * (Dn + P)], [T, R + P]
        else:
            q_in = self.q_proj if self.q_lora_rank is None else self.q_a_proj
            q, kv = q_in(x), self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)  # [T, H, Dn], [T, H, P]
        c_kv, k_pe = kv.split([self.rank, self.rope], dim=-1)  # [T, R], [T, P]
        k_pe = k_pe.unsqueeze(1)  # [T, 1, P]: one key shared by every head
        if self.interleaved:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        latent = torch.cat([self.kv_a_layernorm(c_kv).unsqueeze(1), k_pe], dim=-1)
        w_uk = self._kv_b_heads()[0]  # [H, Dn, R]
        q_abs = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
        return torch.cat([q_abs, q_pe], dim=-1), (q_nope, q_pe), latent

    def _kv_b_heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's per-head up-projections: W_uk `[H, Dn, R]`, W_uv `[H, Dv, R]`."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]
