"""What training minimises and evaluation reports, per sequence and layer.

All three errors are relative squared errors, sum ||approx - exact||^2 / sum ||exact||^2,
so layers and K/V of very different magnitudes weigh alike:

- `k`, `v`: over the compressed tokens only (sink and centers are stored exactly);
- `attn`: the attention output of the captured queries (their own positions, causal,
  the layer's scale, GQA) over every key of the sequence, compressed keys and values
  replaced by their reconstructions (keys rotated back to their positions), against the
  output over the exact K/V. This is the distillation term: it weighs the reconstruction
  error by what the queries actually read.

Each error is kept as numerator and denominator (`Ratio`) so that evaluation can pool
sums over sequences instead of averaging ratios.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparsevllm.deltakv.compressor import DeltaKVCompressor, split_kv
from sparsevllm.deltakv.rope import rotate
from sparsevllm.deltakv_tools.dataset import LayerView, SequenceViews

# (tokens `[N, C]`, their references `[N, R, C]`) -> reconstructed tokens `[N, C]`.
Reconstruct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def round_trip(c: DeltaKVCompressor, layer: int) -> Reconstruct:
    """The compressor's compress-then-reconstruct at `layer`, as a `Reconstruct`."""

    def reconstruct(tokens: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        return c.reconstruct(layer, c.compress(layer, tokens, refs), refs)

    return reconstruct


@dataclass
class Ratio:
    num: torch.Tensor
    den: torch.Tensor

    @property
    def value(self) -> torch.Tensor:
        return self.num / self.den.clamp_min(1e-30)


@dataclass
class LayerErrors:
    k: Ratio
    v: Ratio
    attn: Ratio | None  # None: the sequence has no captured queries


def ratio(approx: torch.Tensor, exact: torch.Tensor) -> Ratio:
    return Ratio(((approx - exact) ** 2).sum(), (exact**2).sum())


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[Q, Hq, D]` at positions `q_pos` `[Q]`, keys (post-RoPE) and values `[T, Hkv, D]`
    at positions 0..T-1 -> causal softmax attention output `[Q, Hq, D]`."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1)  # [T, Hq, D]
    vv = v.repeat_interleave(group, dim=1)  # [T, Hq, D]
    logits = torch.einsum("qhd,thd->hqt", q, kk) * scale  # [Hq, Q, T]
    future = torch.arange(k.shape[0], device=k.device)[None, :] > q_pos[:, None]  # [Q, T]
    probs = logits.masked_fill(future[None], float("-inf")).softmax(dim=-1)
    return torch.einsum("hqt,thd->qhd", probs, vv)  # [Q, Hq, D]


def _output(view: LayerView, x: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    k, v = split_kv(x, num_kv_heads, head_dim)  # [T, Hkv, D] each, pre-RoPE keys
    positions = torch.arange(x.shape[0], device=x.device)
    k = rotate(k, positions, view.rope)
    return attention_output(view.queries, k, v, view.query_positions, view.scale)


def layer_errors(
    view: LayerView, reconstruct: Reconstruct, num_kv_heads: int, head_dim: int
) -> LayerErrors:
    """The errors of `reconstruct` on one sequence at one layer (differentiable)."""
    target = view.x[view.compressed]  # [N, C]
    approx = reconstruct(target, view.x[view.refs])  # [N, C]
    k_hat, v_hat = split_kv(approx, num_kv_heads, head_dim)
    k, v = split_kv(target, num_kv_heads, head_dim)
    attn = None
    if view.queries.numel():
        if view.exact_output is None:
            with torch.no_grad():
                view.exact_output = _output(view, view.x, num_kv_heads, head_dim)
        full = view.x.index_put((view.compressed,), approx.to(view.x.dtype))  # [T, C]
        attn = ratio(_output(view, full, num_kv_heads, head_dim), view.exact_output)
    return LayerErrors(ratio(k_hat, k), ratio(v_hat, v), attn)


@dataclass(frozen=True)
class LossWeights:
    k: float = 1.0
    v: float = 1.0
    attn: float = 1.0


def combined(errors: LayerErrors, w: LossWeights) -> torch.Tensor:
    """The training objective of one layer: weighted sum of the three relative errors."""
    loss = w.k * errors.k.value + w.v * errors.v.value
    if errors.attn is not None:
        loss = loss + w.attn * errors.attn.value
    return loss


def pooled_errors(views: SequenceViews, layer: int, reconstruct: Reconstruct) -> dict[str, float]:
    """Relative K, V and attention errors of `reconstruct` at `layer`, sums pooled over
    every sequence of `views` (no gradient)."""
    spec = views.spec
    sums = {name: [0.0, 0.0] for name in ("k", "v", "attn")}
    with torch.no_grad():
        for i in range(len(views)):
            e = layer_errors(views.view(i, layer), reconstruct, spec.num_kv_heads, spec.head_dim)
            for name, r in (("k", e.k), ("v", e.v), ("attn", e.attn)):
                if r is not None:
                    sums[name][0] += float(r.num)
                    sums[name][1] += float(r.den)
    return {name: num / den for name, (num, den) in sums.items() if den > 0}


def layer_mean(per_layer: dict[int, dict[str, float]], w: LossWeights) -> dict[str, float]:
    """Mean over layers of each error, and of the weighted objective (`loss`)."""
    out: dict[str, float] = {}
    for name in ("k", "v", "attn"):
        values = [e[name] for e in per_layer.values() if name in e]
        if values:
            out[name] = sum(values) / len(values)
    loss = w.k * out.get("k", 0.0) + w.v * out.get("v", 0.0) + w.attn * out.get("attn", 0.0)
    return {"loss": loss, **out}
