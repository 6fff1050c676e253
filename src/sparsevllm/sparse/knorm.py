"""KNorm (Devoto et al., 2024): keep the keys with the lowest L2 norm.

Query-agnostic: low-norm keys tend to receive high attention. At the end of the
prompt each KV head keeps sink + recent + the lowest-norm keys, `decode_keep_tokens`
in all; generated tokens are appended without further eviction.
"""

from __future__ import annotations

from sparsevllm.sparse.base import ScoreEviction


class KNorm(ScoreEviction):
    name = "knorm"

    def score(self, layer, step, kv, attn):
        keys = kv.keys(step.seq_id, layer)  # [L, Hkv, D]
        return -keys.float().norm(dim=-1).t()  # [Hkv, L]: a lower norm is more important
