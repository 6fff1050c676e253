"""DeltaKV serving (Hao et al., 2026): tokens outside the sink, the centers and the recent
window are stored as learned latent residuals and reconstructed when a step reads them.

The definition (`sparsevllm.deltakv`) fixes what a compressed token is; this method
decides when and where: it brings its own storage format (kv/deltakv.py, through
`storage_format`), so that the pool's slots of compressed tokens hold latent codes and
the full-precision K/V of sink, centers and recent windows live in shared rows.

- *compress on store*: after every step, each of the step's sequences compresses the
  tokens that left its recent window (positions [start - recent, end - recent) of the
  step, centers and the first `sink_keep_tokens` excepted). A view the prefix store
  adopts (a finished request's radix entry or idle chain) is compressed whole first
  (`finish_view`), so cached KV holds only sinks, centers and latents: a radix hit or a
  chain continuation reads what a request reads after a finished request's prefix. A
  prompt chunk that does not end the prompt follows the step rule (its recent window
  stays full), so a prompt cut by the scheduler reads what decode would read. A prefill
  chunk reads its own K/V as computed and older tokens as stored (as every lossy format:
  attention/torch_ref.py).
- *reconstruct in decode*: the storage reads a compressed token as
  up(latent) + mean(its references' pre-RoPE vectors), the key rotated again at its
  position (`TokenCodec.decode`); the torch reference attention gathers those rows into
  its scratch tensors. With `deltakv_topk` > 0 a decode query reads the full-precision
  tokens and only the `deltakv_topk` compressed tokens whose base key (the mean of their
  references, rotated at their position) scores highest against it.

The reference rule (sink, stride, references) and the latent widths are the
checkpoint's; the method reads them from its metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sparsevllm.deltakv.centers import is_center
from sparsevllm.deltakv.checkpoint import CheckpointInfo, load_compressor, read_info
from sparsevllm.deltakv.compressor import DeltaKVCompressor, join_kv, split_kv
from sparsevllm.deltakv.latent_codes import PackedLatents, pack_latents, unpack_latents
from sparsevllm.deltakv.rope import rotate, unrotate
from sparsevllm.kv.deltakv import DeltaKVStorage, deltakv_format
from sparsevllm.kv.format import KVFormat, KVPair, KVStorage
from sparsevllm.sparse.base import KVAccess, MethodSettings, RowScores, SeqStep, SparseMethod
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, MethodSpec, knob

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.calibration.schema import ModelIdentity

LATENT_BITS = (4, 16)


@dataclass(frozen=True)
class DeltaKVKnobs(MethodKnobs):
    deltakv_checkpoint: str = knob(
        "",
        "DeltaKV: path of the compressor checkpoint trained for the model (required; "
        "`sparsevllm deltakv train` makes one).",
    )
    deltakv_latent_bits: int = knob(
        4, "DeltaKV: bits per stored latent value: 4 (INT4 codes) or 16 (float16)."
    )
    deltakv_topk: int = knob(
        0,
        "DeltaKV: compressed tokens a decode query reconstructs and reads, the best by "
        "their base key's score (0: all of them).",
        minimum=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.deltakv_checkpoint:
            raise ValueError(
                "deltakv needs deltakv_checkpoint: the path of a compressor trained for "
                "this model (`sparsevllm deltakv collect` then `sparsevllm deltakv train`)"
            )
        if self.deltakv_latent_bits not in LATENT_BITS:
            raise ValueError(
                f"deltakv_latent_bits must be one of {LATENT_BITS}, got {self.deltakv_latent_bits}"
            )


class TokenCodec:
    """One layer's way between pool K/V and codes: pre-RoPE vectors, latents, bytes."""

    def __init__(
        self,
        compressor: DeltaKVCompressor,
        layer: int,
        freqs: torch.Tensor | None,
        bits: int,
    ) -> None:
        self.compressor, self.layer, self.freqs, self.bits = compressor, layer, freqs, bits
        self.width = compressor.spec.latent_dim(layer)
        self.num_kv_heads, self.head_dim = compressor.spec.num_kv_heads, compressor.spec.head_dim

    def code_bytes(self) -> int:
        return self.width // 2 + 4 if self.bits == 4 else 2 * self.width

    def vectors(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Post-RoPE K, V `[n, Hkv, D]` at positions `[n]` -> vectors `[n, C]` float32
        (keys turned back to pre-RoPE: what the compressor reads)."""
        return join_kv(unrotate(k, pos, self.freqs), v.float())

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
            return codes.contiguous().view(torch.float16).float()
        half = self.width // 2
        params = codes[:, half:].contiguous().view(torch.float16).view(-1, 1, 2)
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
        if codes.is_cuda and self.compressor.spec.hidden_dim == 0:
            from sparsevllm.attention.triton.deltakv import reconstruct

            up = self.compressor.codec(self.layer).up_proj
            dtype = next(up.parameters()).dtype
            y = up(self.latents(codes).to(dtype))  # [n, 2 * Hkv * D]
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
        x = self.compressor.reconstruct(self.layer, self.latents(codes), refs.view(n, r, -1))
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
    xt: torch.Tensor, t_pos: torch.Tensor, xc: torch.Tensor, c_pos: torch.Tensor, count: int
) -> torch.Tensor:
    """The definition's references (deltakv/centers.py `select_references`) of tokens
    `xt` `[n, C]` at `t_pos` `[n]` among centers `xc` `[M, C]` at `c_pos` `[M]`: the
    `count` nearest earlier centers in squared L2, ties to the earlier: `[n, count]`
    indices into the centers, nearest first."""
    dist = (xt * xt).sum(-1, keepdim=True) + (xc * xc).sum(-1)[None, :] - 2.0 * (xt @ xc.T)
    dist = dist.masked_fill(c_pos[None, :] > t_pos[:, None], float("inf"))  # [n, M]
    return torch.sort(dist, dim=-1, stable=True).indices[:, :count]


class DeltaKV(SparseMethod):
    name = "deltakv"
    # A top-k of compressed tokens is picked on the host (select_view); with
    # deltakv_topk 0 every row reads its whole view.
    decode_views = DecodeViews.EAGER
    knobs: DeltaKVKnobs

    def __init__(
        self,
        config: MethodSettings,
        num_layers: int,
        num_kv_heads: int,
        layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__(config, num_layers, num_kv_heads, layers)
        self.info = _read_checkpoint(self.knobs.deltakv_checkpoint)
        self.compressor: DeltaKVCompressor | None = None
        self.codecs: dict[int, TokenCodec] = {}
        self.storages: dict[int, DeltaKVStorage] = {}

    def bind_model(self, model: ModelIdentity) -> None:
        """Load the compressor, refusing one trained for another model."""
        self.compressor, _ = load_compressor(self.knobs.deltakv_checkpoint, model)
        self._check_shape()

    def _check_shape(self) -> None:
        spec = self.info.spec
        if spec.layers != self.layers or spec.num_kv_heads != self.num_kv_heads:
            raise ValueError(
                f"{self.info.path} compresses layers {list(spec.layers)} with "
                f"{spec.num_kv_heads} KV heads; this model's managed layers are "
                f"{list(self.layers)} with {self.num_kv_heads} KV heads"
            )

    # -- storage ----------------------------------------------------------------------
    def storage_format(self, base: KVFormat) -> KVFormat:
        spec = self.info.spec
        bits = self.knobs.deltakv_latent_bits
        width = max(spec.latent_dims)
        code = width // 2 + 4 if bits == 4 else 2 * width
        full = self._sink() + self.config.recent_keep_tokens + spec.center_stride + 1
        return deltakv_format(code, spec.num_references, spec.center_stride, full)

    def attach_storage(self, storages: Sequence[KVStorage], kv: KVAccess) -> None:
        # The compressor runs where the KV lives (a checkpoint loads on the CPU).
        compressor = self._loaded().to(storages[self.layers[0]].device)
        for layer in self.layers:
            storage = storages[layer]
            if not isinstance(storage, DeltaKVStorage):
                raise ValueError(f"deltakv needs its own storage at layer {layer}")
            codec = TokenCodec(
                compressor, layer, kv.rope_frequencies(layer), self.knobs.deltakv_latent_bits
            )
            storage.attach_decoder(codec)
            self.codecs[layer], self.storages[layer] = codec, storage

    def _loaded(self) -> DeltaKVCompressor:
        if self.compressor is None:  # no model identity was given (harnesses)
            self.compressor, _ = load_compressor(self.knobs.deltakv_checkpoint)
            self._check_shape()
        return self.compressor

    def _sink(self) -> int:
        return max(self.config.sink_keep_tokens, self.info.spec.sink_tokens)

    # -- compress on store ------------------------------------------------------------
    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        """Compress what left the recent window, after a prompt chunk as after a decode
        token: the next chunk reads the window before it in full precision, so where the
        scheduler cuts a prompt (another prompt took part of the step) costs only the
        tokens older than the window, which decode reads reconstructed anyway."""
        recent = self.config.recent_keep_tokens
        for step in steps:
            lo, hi = max(0, step.start - recent), step.end - recent
            if hi > lo:
                self._compress(step.seq_id, lo, hi, kv)

    def finish_view(self, seq_id: int, kv: KVAccess) -> None:
        """Before the prefix store adopts the view: compress its recent window too."""
        self._compress(seq_id, 0, kv.resident(seq_id, self.layers[0]), kv)

    def _compressible(self, lo: int, hi: int) -> torch.Tensor:
        """Positions in [lo, hi) stored as latents: `[n]` int64."""
        spec = self.info.spec
        pos = torch.arange(max(lo, self._sink()), max(hi, lo, self._sink()))
        return pos[~is_center(pos, spec.sink_tokens, spec.center_stride)]

    def _compress(self, seq_id: int, lo: int, hi: int, kv: KVAccess) -> None:
        """Compress the full tokens at positions [lo, hi) of `seq_id` at every layer (one
        view serves them all: the method keeps every token, view index = position)."""
        pos = self._compressible(lo, hi)
        if not pos.numel():
            return
        view = torch.tensor(kv.view_slots(seq_id, self.layers[0]), dtype=torch.long)
        spec = self.info.spec
        c_pos = torch.arange(int(pos.max()))
        c_pos = c_pos[is_center(c_pos, spec.sink_tokens, spec.center_stride)]
        for layer in self.layers:
            storage = self.storages[layer]
            slots = view[pos].to(storage.device)
            full = storage.is_full(slots).cpu()
            if bool(full.any()):
                self._compress_layer(layer, pos[full], slots[full.to(slots.device)], c_pos, view)

    def _compress_layer(
        self,
        layer: int,
        pos: torch.Tensor,  # [n] positions to compress
        slots: torch.Tensor,  # [n] their slots
        c_pos: torch.Tensor,  # [M] center positions before the last of them
        view: torch.Tensor,  # [L] the sequence's slots (host)
    ) -> None:
        storage, codec = self.storages[layer], self.codecs[layer]
        device = storage.device
        c_slots = view[c_pos].to(device)
        pos_d, c_pos_d = pos.to(device), c_pos.to(device)
        xt = codec.vectors(*storage.read(slots), pos_d)  # [n, C]
        xc = codec.vectors(*storage.read(c_slots), c_pos_d)  # [M, C]
        idx = nearest_centers(xt, pos_d, xc, c_pos_d, self.info.spec.num_references)  # [n, R]
        latent = self._loaded().compress(layer, xt, xc[idx])  # [n, r]
        storage.compress(slots, pos_d, codec.encode(latent), c_slots[idx], c_pos_d[idx])

    # -- reconstruct in decode: which compressed tokens a query reads -----------------
    def select_view(
        self, layer: int, row: int, q: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | None:
        """Every full-precision token plus the `deltakv_topk` compressed ones whose base
        key scores best against the query (summed over query heads): `[B]` positions."""
        topk = self.knobs.deltakv_topk
        if not topk:
            return None
        storage = self.storages[layer]
        view = batch.view(batch.group_of_layer[layer], row)[:-1].long()  # [L] context
        compressed = (~storage.is_full(view)).nonzero().flatten()  # [m]
        if compressed.numel() <= topk:
            return None
        slots = view[compressed]
        refs = storage.refs[slots].long()  # [m, R]
        base = self.codecs[layer].base_keys(
            storage.full_k[refs], storage.row_pos[refs].long(), storage.pos[slots].long()
        )  # [m, Hkv, D]
        group = q.shape[0] // base.shape[1]
        qf = q.float().view(base.shape[1], group, -1)  # [Hkv, G, D]
        score = torch.einsum("mhd,hgd->m", base, qf)  # [m]
        best = compressed[score.topk(topk).indices]
        keep = storage.is_full(view).clone()
        keep[best] = True
        return keep.nonzero().flatten()


def _read_checkpoint(path: str) -> CheckpointInfo:
    """The checkpoint's metadata, a missing or foreign file named with the knob."""
    try:
        return read_info(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"deltakv_checkpoint: {e}") from e


SPEC = MethodSpec(
    name="deltakv",
    family="compression",
    description="sink + centers + recent window in full precision; every other token a "
    "learned latent residual against its nearest centers, reconstructed when read",
    method=DeltaKV,
    knobs=DeltaKVKnobs,
    budget_fields=("sink_keep_tokens", "recent_keep_tokens"),
    prefix_cache=True,  # every token stays, in view order: radix prefixes are plain
    chain_cache=True,
    prunable=False,  # view index = position, and centers must stay for their referrers
    kv_formats=("auto",),  # the full rows hold the model dtype
    refused_layouts={
        "mla_latent": "DeltaKV compresses per-head K and V (an MLA latent row is "
        "compressed already)"
    },
)
