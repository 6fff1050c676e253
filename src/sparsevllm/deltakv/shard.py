"""The compressor over tensor-parallel ranks: each rank holds some KV heads of a token.

A token vector x is `[K of every KV head, V of every KV head]` (`join_kv`), and a rank
holds the rows of its heads `[kv0, kv1)`: the columns `x_r` of its K block and its V
block. The compressor's maps cut along those columns:

- down: its first linear map reads x, so it is row-parallel. Each rank multiplies its
  columns, `W[:, cols] x_r`, the ranks' partial products are summed (`reduce`, an
  all-reduce), the bias is added once; what follows (GELU and `fc_out` in an MLP map)
  runs whole on every rank. So every rank computes the same latent, as one rank would.
- up: its last linear map writes x, so it is column-parallel. A rank computes only its
  heads' outputs, `W[cols, :] h + b[cols]`, and adds its heads' part of the base.

On one rank (`heads` covering every KV head) the shard calls the compressor itself, so
a single process computes exactly what it did before tensor parallelism existed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.deltakv.compressor import DeltaKVCompressor, reference_mean

Reduce = Callable[[torch.Tensor], torch.Tensor]


def head_columns(heads: tuple[int, int], num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Indices into a token vector of the K and V channels of KV heads `[h0, h1)`."""
    h0, h1 = heads
    k = torch.arange(h0 * head_dim, h1 * head_dim)
    return torch.cat([k, k + num_kv_heads * head_dim])


def _mlp_layers(m: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """An MLP map's (fc_in, act, fc_out)."""
    assert isinstance(m, nn.Sequential)
    first, act, last = m.fc_in, m.act, m.fc_out
    assert isinstance(first, nn.Module) and isinstance(act, nn.Module)
    assert isinstance(last, nn.Module)
    return first, act, last


def _first_linear(down: nn.Module) -> tuple[nn.Linear, nn.Module | None]:
    """A down map's first linear layer, and what follows it (None: nothing)."""
    if isinstance(down, nn.Linear):
        return down, None
    first, act, out = _mlp_layers(down)
    assert isinstance(first, nn.Linear)
    return first, nn.Sequential(act, out)


def _last_linear(up: nn.Module) -> tuple[nn.Module | None, nn.Linear]:
    """An up map's last linear layer, and what precedes it (None: nothing)."""
    if isinstance(up, nn.Linear):
        return None, up
    first, act, last = _mlp_layers(up)
    assert isinstance(last, nn.Linear)
    return nn.Sequential(first, act), last


class CompressorShard:
    """One rank's view of a `DeltaKVCompressor` (module docstring)."""

    def __init__(
        self,
        compressor: DeltaKVCompressor,
        heads: tuple[int, int],
        reduce: Reduce | None = None,
    ) -> None:
        spec = compressor.spec
        self.compressor = compressor
        self.heads = heads
        self.num_kv_heads = heads[1] - heads[0]  # this rank's
        self.whole = self.num_kv_heads == spec.num_kv_heads
        if not self.whole and reduce is None:
            raise ValueError("a compressor shard of some KV heads needs the ranks' sum")
        self.reduce = reduce
        self.cols = head_columns(heads, spec.num_kv_heads, spec.head_dim)
        # Per layer: the rank's weight part, its bias, and the rest of the map (an MLP's
        # layers after the first / before the last; None for a linear map).
        self._down: dict[int, tuple[torch.Tensor, torch.Tensor | None, nn.Module | None]] = {}
        self._up: dict[int, tuple[torch.Tensor, torch.Tensor | None, nn.Module | None]] = {}

    def _param_dtype(self) -> torch.dtype:
        return next(self.compressor.parameters()).dtype

    def up_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last up linear's weight rows of this rank `[C_r, h]` and their bias (the
        compressor's own on one rank)."""
        weight, bias, _ = self._up_parts(layer)
        return weight, bias

    def _down_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, nn.Module | None]:
        if layer not in self._down:
            first, rest = _first_linear(self.compressor.codec(layer).down_proj)
            weight = first.weight.detach()
            if not self.whole:
                weight = weight[:, self.cols.to(weight.device)].contiguous()
            self._down[layer] = (weight, first.bias, rest)
        return self._down[layer]

    def _up_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None, nn.Module | None]:
        if layer not in self._up:
            head, last = _last_linear(self.compressor.codec(layer).up_proj)
            weight = last.weight.detach()
            bias = None if last.bias is None else last.bias.detach()
            if not self.whole:
                cols = self.cols.to(weight.device)
                weight = weight[cols].contiguous()
                bias = None if bias is None else bias[cols].contiguous()
            self._up[layer] = (weight, bias, head)
        return self._up[layer]

    def compress(self, layer: int, kv: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """This rank's columns of tokens `[N, C_r]` and of their references `[N, R, C_r]`
        -> the latents `[N, r]` of the whole tokens (the same on every rank)."""
        if self.whole:
            return self.compressor.compress(layer, kv, centers)
        assert self.reduce is not None
        dtype = self._param_dtype()
        weight, bias, rest = self._down_parts(layer)
        base = reference_mean(centers.to(dtype))  # [N, C_r]
        parts = F.linear(torch.stack([kv.to(dtype), base]), weight)  # [2, N, h]
        summed = self.reduce(parts.contiguous())
        if bias is not None:
            summed = summed + bias
        if rest is not None:
            summed = rest(summed)
        return summed[0] - summed[1]

    def reconstruct(self, layer: int, latent: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """Latents `[N, r]` and this rank's columns of the references `[N, R, C_r]` ->
        this rank's columns of the token vectors `[N, C_r]`."""
        if self.whole:
            return self.compressor.reconstruct(layer, latent, centers)
        dtype = self._param_dtype()
        weight, bias, head = self._up_parts(layer)
        hidden = latent.to(dtype) if head is None else head(latent.to(dtype))
        return F.linear(hidden, weight, bias) + reference_mean(centers.to(dtype))

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """A per-rank partial sum (e.g. of squared distances over the rank's channels)
        summed over the ranks (itself on one rank)."""
        return partial if self.reduce is None else self.reduce(partial.contiguous())
