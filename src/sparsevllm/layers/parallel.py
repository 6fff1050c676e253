"""Tensor parallelism inside the model: which heads and rows a rank owns, the
collectives, and the layers that need them.

A rank of `size` holds:
- attention: `num_heads / size` query heads and their KV heads; when there are fewer
  KV heads than ranks, each KV head is replicated on the ranks whose query heads read it
  (`head_ranges`);
- the gated MLP: `intermediate / size` rows of gate/up and the same columns of down;
- the embedding and the LM head: a contiguous `ceil(vocab / size)` block of the vocabulary
  (the last rank's block padded with zero rows).
Column-parallel projections (q/k/v, gate/up) need no communication; a row-parallel
projection (o_proj, down_proj) sums the ranks' partial products with one all-reduce, and
the LM head gathers the ranks' logits. Modules of other shapes (MLA attention, routed
experts) stay whole on every rank: replicated, they compute the same values everywhere.

The collectives are `torch.distributed`'s (gloo on CPU, NCCL on CUDA) over the group the
engine creates; `SINGLE` is the one-rank group whose collectives do nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sparsevllm.layers.linear import Projections


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (`group` None: one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    @property
    def active(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (returned for chaining)."""
        if self.active:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The ranks' `x` (same shape on every rank) joined along `dim`, in rank order."""
        if not self.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` on every rank, in place."""
        if self.active:
            torch.distributed.broadcast(x, src=src, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value` (sizes every rank must agree on)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.long)
        if torch.distributed.get_backend(self.group) == "nccl":
            t = t.cuda()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


@dataclass(frozen=True)
class HeadShard:
    """The query heads and KV heads of one rank, as `[start, stop)` of the model's."""

    q: tuple[int, int]
    kv: tuple[int, int]
    num_kv_heads: int  # the model's, for gathering per-head values back

    @property
    def num_local_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def head_ranges(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadShard:
    """Rank `tp.rank`'s heads; errors name the counts that do not divide."""
    if num_heads % tp.size:
        raise ValueError(
            f"tensor_parallel_size {tp.size} must divide the model's {num_heads} attention heads"
        )
    q_per = num_heads // tp.size
    q = (tp.rank * q_per, (tp.rank + 1) * q_per)
    if num_kv_heads % tp.size == 0:
        kv_per = num_kv_heads // tp.size
        return HeadShard(q, (tp.rank * kv_per, (tp.rank + 1) * kv_per), num_kv_heads)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp.size} and the model's {num_kv_heads} KV heads: one "
            "must divide the other (KV heads are split over ranks, or replicated when "
            "there are fewer of them than ranks)"
        )
    # Fewer KV heads than ranks: each rank keeps the one KV head its query heads read.
    group = num_heads // num_kv_heads
    head = q[0] // group
    return HeadShard(q, (head, head + 1), num_kv_heads)


def vocab_range(vocab: int, tp: TensorParallel) -> tuple[int, int]:
    """Rank `tp.rank`'s `[start, stop)` of the (padded) vocabulary."""
    per = -(-vocab // tp.size)
    return tp.rank * per, (tp.rank + 1) * per


# A checkpoint tensor (full, HF-shaped) -> this rank's part of it.
Slicer = Callable[[torch.Tensor], torch.Tensor]


def rows(start: int, stop: int, dim: int = 0) -> Slicer:
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.narrow(dim, start, stop - start)

    return cut


def padded_rows(start: int, stop: int) -> Slicer:
    """Rows `[start, stop)` of dim 0, zero rows past the tensor's end (a padded vocab)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        part = t[start:stop]
        if part.shape[0] == stop - start:
            return part
        pad = t.new_zeros((stop - start - part.shape[0], *t.shape[1:]))
        return torch.cat([part, pad])

    return cut


class RowParallelLinear(nn.Linear):
    """`nn.Linear` over this rank's input columns; the partial products are summed over
    the ranks before the bias is added once. Parameter names stay nn.Linear's."""

    tp: TensorParallel = SINGLE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """`nn.Embedding` over this rank's block of the vocabulary: ids outside it look up
    zeros, and the ranks' rows are summed (each id lives on exactly one rank)."""

    tp: TensorParallel = SINGLE
    start: int = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class VocabParallelHead(nn.Linear):
    """The LM head over this rank's vocabulary block; the logits are gathered over the
    ranks and cut back to the model's vocabulary."""

    tp: TensorParallel = SINGLE
    vocab: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight, self.bias)  # [S, vocab / size]
        return self.tp.all_gather(local, dim=-1)[..., : self.vocab]


def _like(linear: nn.Linear, cls: type[nn.Linear], out_f: int, in_f: int) -> nn.Linear:
    """A `cls` of the given size on `linear`'s device and dtype, without drawn weights."""
    w = linear.weight
    new = cls(in_f, out_f, bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    return new


class ModelSharder:
    """Cuts a built (not yet fused or loaded) model down to one rank's part, and records
    how each checkpoint tensor is sliced for that rank (`slicers`, by HF name)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.slicers: dict[str, Slicer] = {}
        self.heads: HeadShard | None = None

    def shard(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            prefix = f"{name}." if name else ""
            if _is_head_attention(module):
                self._attention(prefix, module)
            elif _is_gated_mlp(module):
                self._mlp(prefix, module)
        self._vocab(model)

    def _attention(self, prefix: str, attn: Any) -> None:
        shard = head_ranges(attn.num_heads, attn.num_kv_heads, self.tp)
        self.heads = shard
        d = attn.head_dim
        q0, q1 = shard.q[0] * d, shard.q[1] * d
        k0, k1 = shard.kv[0] * d, shard.kv[1] * d
        hidden = attn.q_proj.in_features
        for proj, (a, b) in (("q_proj", (q0, q1)), ("k_proj", (k0, k1)), ("v_proj", (k0, k1))):
            old = getattr(attn, proj)
            setattr(attn, proj, _like(old, nn.Linear, b - a, hidden))
            self._slice(f"{prefix}{proj}", rows(a, b), old.bias is not None)
        o = _like(attn.o_proj, RowParallelLinear, attn.o_proj.out_features, q1 - q0)
        o.tp = self.tp
        attn.o_proj = o
        self.slicers[f"{prefix}o_proj.weight"] = rows(q0, q1, dim=1)
        attn.num_heads = shard.q[1] - shard.q[0]
        attn.num_kv_heads = shard.num_local_kv
        attn.qkv = Projections(attn.q_proj, attn.k_proj, attn.v_proj)

    def _mlp(self, prefix: str, mlp: Any) -> None:
        inter = mlp.gate_proj.out_features
        if inter % self.tp.size:
            raise ValueError(
                f"tensor_parallel_size {self.tp.size} must divide the MLP's intermediate "
                f"size {inter} ({prefix.rstrip('.')})"
            )
        per = inter // self.tp.size
        a, b = self.tp.rank * per, (self.tp.rank + 1) * per
        hidden = mlp.gate_proj.in_features
        for proj in ("gate_proj", "up_proj"):
            old = getattr(mlp, proj)
            setattr(mlp, proj, _like(old, nn.Linear, per, hidden))
            self._slice(f"{prefix}{proj}", rows(a, b), old.bias is not None)
        down = _like(mlp.down_proj, RowParallelLinear, mlp.down_proj.out_features, per)
        down.tp = self.tp
        mlp.down_proj = down
        self.slicers[f"{prefix}down_proj.weight"] = rows(a, b, dim=1)
        mlp.gate_up = Projections(mlp.gate_proj, mlp.up_proj)

    def _vocab(self, model: nn.Module) -> None:
        embed_name, embed = _find_embedding(model)
        vocab = embed.num_embeddings
        a, b = vocab_range(vocab, self.tp)
        w = embed.weight
        new = VocabParallelEmbedding(b - a, w.shape[1], device=w.device, dtype=w.dtype)
        new.tp, new.start = self.tp, a
        _set_module(model, embed_name, new)
        self.slicers[f"{embed_name}.weight"] = padded_rows(a, b)
        head = getattr(model, "lm_head", None)
        if not isinstance(head, nn.Linear):
            return
        tied = head.weight is w
        lm = _like(head, VocabParallelHead, b - a, head.in_features)
        lm.tp, lm.vocab = self.tp, vocab
        if tied:
            lm.weight = new.weight
        model.lm_head = lm
        self.slicers["lm_head.weight"] = padded_rows(a, b)

    def _slice(self, name: str, cut: Slicer, bias: bool) -> None:
        self.slicers[f"{name}.weight"] = cut
        if bias:
            self.slicers[f"{name}.bias"] = cut


def _is_head_attention(module: nn.Module) -> bool:
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    linear = all(isinstance(getattr(module, n, None), nn.Linear) for n in names)
    return linear and all(hasattr(module, a) for a in ("num_heads", "num_kv_heads", "qkv"))


def _is_gated_mlp(module: nn.Module) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    linear = all(isinstance(getattr(module, n, None), nn.Linear) for n in names)
    return linear and isinstance(getattr(module, "gate_up", None), Projections)


def _find_embedding(model: nn.Module) -> tuple[str, nn.Embedding]:
    for name, module in model.named_modules():
        if name.endswith("embed_tokens") and isinstance(module, nn.Embedding):
            return name, module
    raise ValueError(f"{type(model).__name__} has no embed_tokens to split over ranks")


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
