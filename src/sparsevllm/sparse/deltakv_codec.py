"""DeltaKV's per-layer codec (`TokenCodec`) and reference search (`nearest_centers`),
for the `deltakv` method (sparse/deltakv.py), which decides when and what to compress.

The codec moves a layer's tokens between the pool's form (post-RoPE K/V), the
compressor's vectors (keys turned back to pre-RoPE), latents and the stored bytes
(INT4 codes with their scale and zero point, or float16 values), and reads compressed
tokens back as up(latent) + mean(references), the key rotated at its position. It also
hands kernels its linear up map (`up_map`) when the method serves decode through the
fused kernel (attention/triton/decode_deltakv.py). At decode it also measures each
sequence's candidate centers against the token it compresses (`center_distances`): on
CUDA a kernel reads the centers' full rows in place (attention/triton/deltakv_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsevllm.deltakv.compressor import join_kv, split_kv
from sparsevllm.deltakv.latent_codes import PackedLatents, pack_latents, unpack_latents
from sparsevllm.deltakv.rope import RopeTables, rotate, unrotate
from sparsevllm.deltakv.shard import CompressorShard
from sparsevllm.kv.deltakv import DeltaKVStorage, UpMap
from sparsevllm.kv.format import KVPair

# Candidate centers one batched search of decode tokens holds at most (summed over its
# tokens) where it gathers their vectors (the torch search): 65,536 float32 vectors,
# 512 MiB at Llama-3-8B's 2 x 8 x 128 channels.
MAX_SEARCH_ENTRIES = 1 << 16
# The same where the search kernel reads the centers in place and holds only their
# distances: 64 MiB of float32.
MAX_KERNEL_SEARCH_ENTRIES = 1 << 24


@dataclass(frozen=True)
class CenterCandidates:
    """The candidate centers of a batch of tokens to compress, a few tokens of each of
    several sequences, grouped by sequence in order (`sizes[i]` tokens of sequence i).
    Centers are positional, so every sequence has the same candidate positions, padded
    to the widest sequence's `m`; a token's own row is its sequence's."""

    seq_table: torch.Tensor  # [S, m] each sequence's center slots (padding: any full slot)
    sizes: list[int]  # [S] tokens of each sequence
    table: torch.Tensor  # [T, m] each token's sequence's row of seq_table
    valid: torch.Tensor  # [T, m] bool: a center before the token
    c_pos: torch.Tensor  # [m] the centers' positions
    span: int  # > every center position (sizes the search kernel's cos/sin table)


class TokenCodec:
    """One layer's way between pool K/V and codes: pre-RoPE vectors, latents, bytes.
    Vectors hold this rank's KV heads (`shard`: every head on one rank)."""

    def __init__(
        self,
        shard: CompressorShard,
        layer: int,
        freqs: torch.Tensor | None,
        bits: int,
        fused: bool = False,
        rope_tables: RopeTables | None = None,
        kernel: str = "rebuild",
    ) -> None:
        self.shard, self.layer, self.freqs, self.bits = shard, layer, freqs, bits
        self.fused = fused  # hand kernels the up map (deltakv_fused_decode)
        self.kernel = kernel  # which one (deltakv_decode_kernel)
        # The center search kernel's cos/sin tables (shared by a method's layers).
        self.rope_tables = rope_tables if rope_tables is not None else RopeTables()
        spec = shard.compressor.spec
        self.width = spec.latent_dim(layer)
        self.num_kv_heads, self.head_dim = shard.num_kv_heads, spec.head_dim
        self._up_cache: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def _up_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The linear up map's weight `[C, r]` and bias `[C]` (this rank's rows) for the
        GEMM of a pool in `dtype`: float32 for a float32 pool; a 16-bit pool, whose rows
        hold the result in 16 bits anyway, runs the GEMM in its dtype (float32
        accumulation) from a copy made once, which reads W_up in half the bytes and runs
        on the tensor cores."""
        weight, bias = self.shard.up_rows(self.layer)
        if dtype.itemsize >= weight.dtype.itemsize:
            return weight, bias
        cached = self._up_cache.get(dtype)
        if cached is None or cached[0].device != weight.device:
            cached = (weight.to(dtype), None if bias is None else bias.to(dtype))
            self._up_cache[dtype] = cached
        return cached

    def up_map(self, dtype: torch.dtype) -> UpMap | None:
        """The linear up map in the GEMM dtype of a pool in `dtype` (`_up_weights`), for
        the decode kernel (attention/triton/decode_deltakv.py); None for an MLP up map
        or without `fused`."""
        if not self.fused or self.shard.compressor.spec.hidden_dim:
            return None
        weight, bias = self._up_weights(dtype)
        return UpMap(weight, bias, self.freqs, self.bits, self.kernel)

    def code_bytes(self) -> int:
        return self.width // 2 + 4 if self.bits == 4 else 2 * self.width

    def vectors(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Post-RoPE K, V `[n, Hkv, D]` at positions `[n]` -> vectors `[n, C]` float32
        (keys turned back to pre-RoPE: what the compressor reads)."""
        return join_kv(unrotate(k, pos, self.freqs), v.float())

    def search_limit(self, device: torch.device) -> int:
        """Token x candidate-center entries one batched search (`center_distances`) may
        hold on `device`."""
        if self._search_kernel(device):
            return MAX_KERNEL_SEARCH_ENTRIES
        return MAX_SEARCH_ENTRIES

    def _search_kernel(self, device: torch.device) -> bool:
        # The kernel splits keys into rotate-half halves: an odd head size cannot.
        return device.type == "cuda" and self.head_dim % 2 == 0

    def center_distances(
        self, storage: DeltaKVStorage, xt: torch.Tensor, cand: CenterCandidates
    ) -> torch.Tensor:  # [T, m] float32
        """Squared L2 distances between the tokens `xt` `[T, C]` (float32) and their
        candidate centers over this rank's channels, +inf where not `cand.valid`. On
        CUDA the search kernel reads the centers' rows in place
        (attention/triton/deltakv_search.py); elsewhere (and for an odd head size, which
        the kernel's halves cannot split) the torch reference builds each sequence's
        centers' vectors `[m, C]` once and measures its tokens against them."""
        if self._search_kernel(xt.device):
            from sparsevllm.attention.triton.deltakv_search import center_distances

            rope = None
            if self.freqs is not None:
                rope = self.rope_tables.get(self.freqs, xt.device, cand.span)
            st, fk, fv = storage.state, storage.full_k, storage.full_v
            return center_distances(xt, fk, fv, st, cand.table, cand.c_pos, cand.valid, rope)
        s, m = cand.seq_table.shape
        ck, cv = storage.read_full(cand.seq_table.reshape(-1))  # [S * m, Hkv, D]
        xc = self.vectors(ck, cv, cand.c_pos.repeat(s)).view(s, m, -1)  # [S, m, C]
        dots = [x @ c.T for x, c in zip(xt.split(cand.sizes), xc, strict=True)]
        sq = (xc * xc).sum(-1).repeat_interleave(torch.tensor(cand.sizes), dim=0)  # [T, m]
        dist = (xt * xt).sum(-1, keepdim=True) + sq - 2.0 * torch.cat(dots)
        return dist.masked_fill(~cand.valid, float("inf"))

    def encode(self, latent: torch.Tensor) -> torch.Tensor:
        """Latents `[n, r]` -> stored bytes `[n, code_bytes]` uint8."""
        if self.bits == 16:
            return latent.to(torch.float16).contiguous().view(torch.uint8)
        packed = pack_latents(latent)  # codes [n, r/2], params [n, 1, 2] float16
        params = packed.params.reshape(latent.shape[0], -1).contiguous().view(torch.uint8)
        return torch.cat([packed.codes, params], dim=1)

    def latents(self, codes: torch.Tensor) -> torch.Tensor:
        """Stored bytes `[n, >= code_bytes]` -> latents `[n, r]` float32 (a layer narrower
        than the widest one uses a prefix of its slot's bytes)."""
        codes = codes[:, : self.code_bytes()]
        if self.bits == 16:
            return _halves(codes).float()
        half = self.width // 2
        params = _halves(codes[:, half:]).view(-1, 1, 2)
        return unpack_latents(PackedLatents(codes[:, :half], params))

    def decode(
        self,
        codes: torch.Tensor,  # [n, >= code_bytes] uint8
        full_k: torch.Tensor,  # [rows, Hkv, D] the storage's full rows (post-RoPE keys)
        full_v: torch.Tensor,  # [rows, Hkv, D]
        refs: torch.Tensor,  # [n, R] int64 rows of each token's references
        row_pos: torch.Tensor,  # [rows] int32 positions of the rows
        pos: torch.Tensor,  # [n] int64
    ) -> KVPair:
        """K (rotated at `pos`), V `[n, Hkv, D]` float32: a GEMM and the Triton epilogue
        on CUDA for linear up maps, else `decode_reference`."""
        if codes.is_cuda and self.shard.compressor.spec.hidden_dim == 0:
            from sparsevllm.attention.triton.deltakv import reconstruct

            weight, bias = self._up_weights(full_k.dtype)
            y = F.linear(self.latents(codes).to(weight.dtype), weight, bias)  # [n, 2*Hkv*D]
            return reconstruct(y, full_k, full_v, refs, row_pos, pos, self.freqs)
        return self.decode_reference(codes, full_k[refs], full_v[refs], row_pos[refs].long(), pos)

    def decode_reference(
        self,
        codes: torch.Tensor,  # [n, >= code_bytes]
        ref_k: torch.Tensor,  # [n, R, Hkv, D]
        ref_v: torch.Tensor,
        ref_pos: torch.Tensor,  # [n, R]
        pos: torch.Tensor,  # [n]
    ) -> KVPair:
        """x^ = up(latent) + mean(references), the key rotated at `pos`: `[n, Hkv, D]`."""
        n, r = ref_pos.shape
        refs = self.vectors(ref_k.flatten(0, 1), ref_v.flatten(0, 1), ref_pos.reshape(-1))
        x = self.shard.reconstruct(self.layer, self.latents(codes), refs.view(n, r, -1))
        k, v = split_kv(x.float(), self.num_kv_heads, self.head_dim)  # [n, Hkv, D] each
        return rotate(k, pos, self.freqs), v

    def base_keys(
        self, ref_k: torch.Tensor, ref_pos: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """The rotated key part of each token's base: ref_k `[n, R, Hkv, D]` -> `[n, Hkv, D]`."""
        n, r = ref_pos.shape
        pre = unrotate(ref_k.flatten(0, 1), ref_pos.reshape(-1), self.freqs)
        return rotate(pre.view(n, r, *pre.shape[1:]).mean(dim=1), pos, self.freqs)


def nearest_centers(
    xt: torch.Tensor,
    t_pos: torch.Tensor,
    xc: torch.Tensor,
    c_pos: torch.Tensor,
    count: int,
    shard: CompressorShard,
) -> torch.Tensor:
    """The definition's references (deltakv/centers.py `select_references`) of tokens
    `xt` `[n, C]` at `t_pos` `[n]` among centers `xc` `[M, C]` at `c_pos` `[M]`: the
    `count` nearest earlier centers in squared L2, ties to the earlier: `[n, count]`
    indices into the centers, nearest first. Over ranks, each holds some channels of
    the vectors: the distances over them are summed before the search."""
    dist = (xt * xt).sum(-1, keepdim=True) + (xc * xc).sum(-1)[None, :] - 2.0 * (xt @ xc.T)
    dist = shard.sum_over_ranks(dist)  # [n, M]
    dist = dist.masked_fill(c_pos[None, :] > t_pos[:, None], float("inf"))  # [n, M]
    return torch.sort(dist, dim=-1, stable=True).indices[:, :count]


def _halves(data: torch.Tensor) -> torch.Tensor:
    """Bytes `[n, 2m]` -> float16 `[n, m]`, from a fresh copy: a slice of a slot row
    starts at any byte (one row counts as contiguous, so `.contiguous()` keeps it)."""
    return data.clone(memory_format=torch.contiguous_format).view(torch.float16)
