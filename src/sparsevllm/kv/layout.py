"""What one token of one layer stores, as the model asks for it (torch-free).

The runner asks the model for its `SlotLayout` (a model module's `slot_layout()`; the
attention families without one store K and V per KV head) and sizes and builds every
layer's storage from it; sparse methods are told the layout's name and may refuse one.

- `gqa` (MHA, GQA, MQA): K and V per KV head, `[Hkv, D]` each.
- `mla_latent` (multi-head latent attention: DeepSeek-V2/V3, GLM-4.7-Flash): one row
  per token, the normalised compressed kv `c_kv` (`kv_lora_rank` values) followed by the
  roped shared key `k_pe` (`qk_rope_head_dim`). Attention reads it as a single KV head
  whose key is the whole row and whose value is the row's first `kv_lora_rank` values
  (the query heads are absorbed through `kv_b_proj`, see layers/mla.py), so a slot holds
  one row instead of per-head K and V.
"""

from __future__ import annotations

from dataclasses import dataclass

GQA = "gqa"
MLA_LATENT = "mla_latent"
LAYOUT_NAMES: tuple[str, ...] = (GQA, MLA_LATENT)


@dataclass(frozen=True)
class SlotLayout:
    """A layer's per-token KV: `num_kv_heads` heads with keys of `head_dim` values and
    values of `value_dim`; `shared_kv`: the value is the first `value_dim` entries of the
    key row (one stored buffer, MLA), else a buffer of its own."""

    name: str
    num_kv_heads: int
    head_dim: int
    value_dim: int
    shared_kv: bool = False

    def __post_init__(self) -> None:
        if self.name not in LAYOUT_NAMES:
            raise ValueError(
                f"unknown slot layout {self.name!r} (known: {', '.join(LAYOUT_NAMES)})"
            )
        if min(self.num_kv_heads, self.head_dim, self.value_dim) < 1:
            raise ValueError(f"a slot layout needs positive sizes, got {self}")
        if self.shared_kv and self.value_dim > self.head_dim:
            raise ValueError("a shared value is a prefix of the key row: value_dim <= head_dim")
        if not self.shared_kv and self.value_dim != self.head_dim:
            raise ValueError("separate K and V buffers have one head_dim")

    def key_pair_bytes(self, element_size: int) -> int:
        """Bytes of two key rows of one token (every KV head) at `element_size` bytes a
        value: what a per-page (min, max) key summary takes, K + V of a slot in a per-head
        layout, two latent rows in MLA's."""
        return 2 * self.num_kv_heads * self.head_dim * element_size


def gqa_layout(num_kv_heads: int, head_dim: int) -> SlotLayout:
    return SlotLayout(GQA, num_kv_heads, head_dim, head_dim)


def latent_layout(kv_lora_rank: int, rope_dim: int) -> SlotLayout:
    """MLA: one `[c_kv, k_pe]` row of `kv_lora_rank + rope_dim` values per token."""
    return SlotLayout(MLA_LATENT, 1, kv_lora_rank + rope_dim, kv_lora_rank, shared_kv=True)
