"""DeltaKV serving (Hao et al., 2026): tokens outside the sink, the centers and the recent
window are stored as learned latent residuals and reconstructed when a step reads them.

The definition (`sparsevllm.deltakv`) fixes what a compressed token is; this method
decides when and where: it brings its own storage format (kv/deltakv.py, through
`storage_format`), so that the pool's slots of compressed tokens hold latent codes and
the full-precision K/V of sink, centers and recent windows live in shared rows.

- *compress on store*: after every step, each of the step's sequences compresses the
  tokens that left its recent window, in blocks of `deltakv_compress_interval`
  positions (positions [w(start), w(end)) of the step, w(e) = e - recent rounded down
  to a multiple of the interval; centers and the first `sink_keep_tokens` excepted).
  A view the prefix store adopts (a finished request's radix entry or idle chain) is
  compressed whole first (`finish_view`), so cached KV holds only sinks, centers and
  latents: a radix hit or a chain continuation reads what a request reads after a
  finished request's prefix. A prompt chunk that does not end the prompt follows the step rule (its recent window
  stays full), so a prompt cut by the scheduler reads what decode would read. A prefill
  chunk reads its own K/V as computed and older tokens as stored (as every lossy format:
  attention/torch_ref.py).
- *reconstruct in decode*: the storage reads a compressed token as
  up(latent) + mean(its references' pre-RoPE vectors), the key rotated again at its
  position (`TokenCodec.decode`, sparse/deltakv_codec.py); the torch reference
  attention gathers those rows into its scratch tensors. With `deltakv_topk` > 0 a decode query reads the full-precision
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
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.rope import RopeTables
from sparsevllm.deltakv.shard import CompressorShard
from sparsevllm.kv.deltakv import DeltaKVStorage, deltakv_format
from sparsevllm.kv.format import KVFormat, KVStorage
from sparsevllm.sparse.base import (
    HeadRanks,
    KVAccess,
    MethodSettings,
    RowScores,
    SeqStep,
    SparseMethod,
)
from sparsevllm.sparse.deltakv_codec import CenterCandidates, TokenCodec, nearest_centers
from sparsevllm.sparse.spec import DecodeViews, MethodKnobs, MethodSpec, knob

if TYPE_CHECKING:
    from sparsevllm.attention.backend import ForwardBatch
    from sparsevllm.calibration.schema import ModelIdentity

LATENT_BITS = (4, 16)
DECODE_KERNELS = ("fused", "rebuild")  # attention/triton/decode_deltakv.py, deltakv_rebuild.py
# Token-center distances one search of a sequence's tokens holds at most: 64 MiB of
# float32 (a prompt chunk, or a whole view compressed before the prefix store adopts it).
MAX_SEARCH_CELLS = 1 << 24
# A sequence with at most this many tokens to compress in a step (decode steps, short
# chunks) joins the step's batched search; more (a prompt chunk) searches on its own.
BATCHED_TOKENS = 64


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
    deltakv_compress_interval: int = knob(
        16,
        "DeltaKV: tokens leave the recent window for compression in blocks of this many "
        "positions (positions below a multiple of it), so the window holds between "
        "recent_keep_tokens and recent_keep_tokens + interval - 1 full tokens and a "
        "sequence compresses once every `interval` decode steps: the per-step "
        "compression, a few hundred small operations per layer, is amortised. 1: every "
        "token as it leaves the window.",
        minimum=1,
    )
    deltakv_fused_decode: bool = knob(
        True,
        "DeltaKV: decode steps over whole views run a Triton decode kernel (CUDA; "
        "deltakv_decode_kernel picks which) that reconstructs compressed tokens on the "
        "device, and are captured in CUDA graphs, instead of materialising the view "
        "through the torch reference (docs/benchmarks). Off: the materialising path, "
        "eager. CPU runs ignore it.",
    )
    deltakv_decode_kernel: str = knob(
        "rebuild",
        "DeltaKV: the Triton kernel of deltakv_fused_decode. 'rebuild': a kernel rebuilds "
        "the views' keys and values into a dense scratch (groups of sequences, at most "
        "512 MiB), then the dense decode kernel attends over it (on an H100 at 32K, "
        "0.87 against 1.43 ms a layer at batch 1, and 2.1x the decode tokens/s at the "
        "largest batch: docs/benchmarks); 'fused': one kernel rebuilds each tile of "
        "compressed keys where it scores it.",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.deltakv_checkpoint:
            raise ValueError(
                "deltakv needs deltakv_checkpoint: the path of a compressor trained for "
                "this model (`sparsevllm deltakv collect` then `sparsevllm deltakv train`)"
            )
        if self.deltakv_decode_kernel not in DECODE_KERNELS:
            raise ValueError(
                f"deltakv_decode_kernel must be one of {DECODE_KERNELS}, got "
                f"{self.deltakv_decode_kernel!r}"
            )
        if self.deltakv_latent_bits not in LATENT_BITS:
            raise ValueError(
                f"deltakv_latent_bits must be one of {LATENT_BITS}, got {self.deltakv_latent_bits}"
            )


class DeltaKV(SparseMethod):
    name = "deltakv"
    # A top-k of compressed tokens is picked on the host (select_view); with
    # deltakv_topk 0 every row reads its whole view (`narrows_decode`).
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
        self.shard: CompressorShard | None = None  # this rank's (attach_storage)
        self.codecs: dict[int, TokenCodec] = {}
        self.storages: dict[int, DeltaKVStorage] = {}

    def bind_model(self, model: ModelIdentity) -> None:
        """Load the compressor, refusing one trained for another model."""
        self.compressor, _ = load_compressor(self.knobs.deltakv_checkpoint, model)
        self._check_layers()

    def _check_layers(self) -> None:
        spec = self.info.spec
        if spec.layers != self.layers:
            raise ValueError(
                f"{self.info.path} compresses layers {list(spec.layers)}; this model's "
                f"managed layers are {list(self.layers)}"
            )

    def _check_shape(self, heads: HeadRanks) -> None:
        """The checkpoint's layers and KV heads against the model's (`heads`: this
        rank's among the model's)."""
        spec = self.info.spec
        if spec.layers != self.layers or spec.num_kv_heads != heads.total:
            raise ValueError(
                f"{self.info.path} compresses layers {list(spec.layers)} with "
                f"{spec.num_kv_heads} KV heads; this model's managed layers are "
                f"{list(self.layers)} with {heads.total} KV heads"
            )
        if heads.shared:
            raise ValueError(
                "deltakv cannot run with more tensor-parallel ranks than the model's "
                f"{heads.total} KV heads (ranks would replicate heads that one latent "
                "compresses together): use at most that many ranks"
            )

    # -- storage ----------------------------------------------------------------------
    def storage_format(self, base: KVFormat) -> KVFormat:
        spec = self.info.spec
        bits = self.knobs.deltakv_latent_bits
        width = max(spec.latent_dims)
        code = width // 2 + 4 if bits == 4 else 2 * width
        interval = self.knobs.deltakv_compress_interval
        full = self._sink() + self.config.recent_keep_tokens + interval + spec.center_stride
        return deltakv_format(code, spec.num_references, spec.center_stride, full)

    def attach_storage(self, storages: Sequence[KVStorage], kv: KVAccess) -> None:
        # The compressor runs where the KV lives (a checkpoint loads on the CPU).
        compressor = self._loaded().to(storages[self.layers[0]].device)
        heads = kv.head_ranks()
        self._check_shape(heads)
        self.shard = CompressorShard(compressor, (heads.start, heads.stop), heads.reduce)
        rope_tables = RopeTables()  # the center search kernel's, shared by the layers
        for layer in self.layers:
            storage = storages[layer]
            if not isinstance(storage, DeltaKVStorage):
                raise ValueError(f"deltakv needs its own storage at layer {layer}")
            codec = TokenCodec(
                self.shard,
                layer,
                kv.rope_frequencies(layer),
                self.knobs.deltakv_latent_bits,
                fused=self.knobs.deltakv_fused_decode,
                rope_tables=rope_tables,
                kernel=self.knobs.deltakv_decode_kernel,
            )
            storage.attach_decoder(codec)
            self.codecs[layer], self.storages[layer] = codec, storage

    def _loaded(self) -> DeltaKVCompressor:
        if self.compressor is None:  # no model identity was given (harnesses)
            self.compressor, _ = load_compressor(self.knobs.deltakv_checkpoint)
            self._check_layers()
        return self.compressor

    def _sink(self) -> int:
        return max(self.config.sink_keep_tokens, self.info.spec.sink_tokens)

    # -- compress on store ------------------------------------------------------------
    def after_step(self, steps: list[SeqStep], scores: RowScores, kv: KVAccess) -> None:
        """Compress what left the recent window, after a prompt chunk as after a decode
        token: the next chunk reads the window before it in full precision, so where the
        scheduler cuts a prompt (another prompt took part of the step) costs only the
        tokens older than the window, which decode reads reconstructed anyway. Tokens
        leave in blocks of `deltakv_compress_interval` positions; sequences with a few
        tokens to compress (decode steps) are compressed together."""
        # The step's stores are done (its tokens were sampled): a full row they could
        # not get is reported here, not by a wait inside every store.
        for storage in self.storages.values():
            storage.check_rows()
        few: list[tuple[int, torch.Tensor]] = []  # (seq_id, positions)
        for step in steps:
            pos = self._compressible(self._window_start(step.start), self._window_start(step.end))
            if 0 < pos.numel() <= BATCHED_TOKENS:
                few.append((step.seq_id, pos))
            elif pos.numel():
                self._compress(step.seq_id, pos, kv)
        if few:
            self._compress_few(few, kv)

    def _window_start(self, end: int) -> int:
        """The first position a sequence of `end` tokens keeps full in its window."""
        interval = self.knobs.deltakv_compress_interval
        return max(0, end - self.config.recent_keep_tokens) // interval * interval

    def finish_view(self, seq_id: int, kv: KVAccess) -> None:
        """Before the prefix store adopts the view: compress its recent window too."""
        pos = self._compressible(0, kv.resident(seq_id, self.layers[0]))
        if pos.numel():
            self._compress(seq_id, pos, kv)

    def _compressible(self, lo: int, hi: int) -> torch.Tensor:
        """Positions in [lo, hi) stored as latents: `[n]` int64."""
        spec = self.info.spec
        pos = torch.arange(max(lo, self._sink()), max(hi, lo, self._sink()))
        return pos[~is_center(pos, spec.sink_tokens, spec.center_stride)]

    def _centers_before(self, end: int) -> torch.Tensor:
        """Center positions before `end`: `[M]` int64 (the same in every sequence)."""
        spec = self.info.spec
        c_pos = torch.arange(end)
        return c_pos[is_center(c_pos, spec.sink_tokens, spec.center_stride)]

    def _compress(self, seq_id: int, pos: torch.Tensor, kv: KVAccess) -> None:
        """Compress the tokens at positions `pos` `[n]` of `seq_id` at every layer (one
        view serves them all: the method keeps every token, view index = position).
        Tokens that are not full any more stay as they are (DeltaKVStorage.compress):
        the host never waits to find out which."""
        view = kv.view_tensor(seq_id, self.layers[0]).long()  # [L] on the device
        c_pos = self._centers_before(int(pos.max())).to(view.device)  # [M]
        c_slots = view[c_pos]
        # The search holds n x M distances: a whole 128K view (finish_view) would need
        # 118K x 13K floats (5.75 GiB), so tokens go in blocks of bounded cells.
        block = max(1, MAX_SEARCH_CELLS // max(1, c_pos.numel()))
        for part in pos.to(view.device).split(block):
            slots = view[part]
            for layer in self.layers:
                self._compress_layer(layer, part, slots, c_pos, c_slots)

    def _compress_layer(
        self,
        layer: int,
        pos: torch.Tensor,  # [n] positions to compress (device)
        slots: torch.Tensor,  # [n] their slots
        c_pos: torch.Tensor,  # [M] center positions before the last of them
        c_slots: torch.Tensor,  # [M] the centers' slots
    ) -> None:
        storage, codec = self.storages[layer], self.codecs[layer]
        # Tokens compressed already read some full row: their codes are not stored.
        xt = codec.vectors(*storage.read_full(slots), pos)  # [n, C]
        xc = codec.vectors(*storage.read_full(c_slots), c_pos)  # [M, C]: centers stay full
        shard = codec.shard
        idx = nearest_centers(xt, pos, xc, c_pos, self.info.spec.num_references, shard)
        latent = shard.compress(layer, xt, xc[idx])  # [n, r]: idx [n, R]
        storage.compress(slots, pos, codec.encode(latent), c_slots[idx], c_pos[idx])

    def _compress_few(self, few: list[tuple[int, torch.Tensor]], kv: KVAccess) -> None:
        """A few tokens `(seq_id, positions [n])` of each of several sequences (a decode
        step's batch), compressed together: per sequence this is `_compress` of its
        positions. A group's search holds its tokens x its widest candidate centers,
        bounded by the codec (`TokenCodec.search_limit`: center vectors on the CPU,
        distances only on CUDA); sequences of similar lengths share a group's padding."""
        c_pos = self._centers_before(max(int(p[-1]) for _, p in few))  # [M]: positional
        first = torch.searchsorted(c_pos, torch.stack([p[0] for _, p in few]))  # [B]
        if int(first.min()) < self.info.spec.num_references:  # only within the sink
            for seq, p in few:
                self._compress(seq, p, kv)
            return
        reach = torch.searchsorted(c_pos, torch.stack([p[-1] for _, p in few]))  # [B]
        views = [kv.view_tensor(seq, self.layers[0]).long() for seq, _ in few]
        limit = self.codecs[self.layers[0]].search_limit(views[0].device)
        group: list[int] = []
        tokens = 0
        for b in torch.argsort(reach, stable=True).tolist():
            n = few[b][1].numel()
            if group and (tokens + n) * int(reach[b]) > limit:
                self._compress_group(group, few, views, c_pos, reach)
                group, tokens = [], 0
            group.append(b)
            tokens += n
        self._compress_group(group, few, views, c_pos, reach)

    def _compress_group(
        self,
        group: list[int],  # indices into `few`
        few: list[tuple[int, torch.Tensor]],  # (seq_id, positions [n] host, ascending)
        views: list[torch.Tensor],  # their views (device slot ids)
        c_pos: torch.Tensor,  # [M] center positions (host)
        reach: torch.Tensor,  # [B] centers before each sequence's last token (host)
    ) -> None:
        """Compress the positions of the sequences in `group` at every layer."""
        m = int(reach[group].max())
        dev = views[0].device
        c_at = c_pos[:m].to(dev)
        # [S, m] each sequence's center slots, padded with its first center (masked out
        # of the search); a token's row is its sequence's.
        seq_table = torch.stack([_padded(views[b][c_at[: int(reach[b])]], m) for b in group])
        pos = torch.cat([few[b][1] for b in group])  # [T] host
        sizes = [few[b][1].numel() for b in group]
        row = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(sizes))  # [T]
        pos_d = pos.to(dev)
        slots = torch.cat(
            [views[b][part] for b, part in zip(group, pos_d.split(sizes), strict=True)]
        )  # [T]
        counts = torch.searchsorted(c_pos[:m], pos)  # [T] centers before each token
        cand = CenterCandidates(
            seq_table=seq_table,
            sizes=sizes,
            table=seq_table[row.to(dev)],
            valid=(torch.arange(m)[None, :] < counts[:, None]).to(dev),
            c_pos=c_at,
            span=int(c_pos[m - 1]) + 1,
        )
        for layer in self.layers:
            self._compress_batch_layer(layer, pos_d, slots, cand)

    def _compress_batch_layer(
        self,
        layer: int,
        pos: torch.Tensor,  # [T] tokens of one or more sequences (device)
        slots: torch.Tensor,  # [T]
        cand: CenterCandidates,
    ) -> None:
        """`_compress_layer` of tokens of several sequences, the center search batched. The
        search reads only distances `[T, m]` (on CUDA a kernel reads the centers' rows in
        place); only the chosen centers' vectors are built."""
        storage, codec = self.storages[layer], self.codecs[layer]
        t = slots.shape[0]
        nref = self.info.spec.num_references
        xt = codec.vectors(*storage.read_full(slots), pos)  # [T, C]
        dist = codec.center_distances(storage, xt, cand)  # [T, m]
        # Summed over ranks (each holds some channels); +inf off `valid` stays +inf.
        dist = codec.shard.sum_over_ranks(dist)
        idx = torch.sort(dist, dim=-1, stable=True).indices[:, :nref]  # [T, R]
        ref_slots, ref_pos = cand.table.gather(1, idx), cand.c_pos[idx]  # [T, R] each
        rk, rv = storage.read_full(ref_slots.reshape(-1))  # [T * R, Hkv, D]
        refs = codec.vectors(rk, rv, ref_pos.reshape(-1)).view(t, nref, -1)  # [T, R, C]
        latent = codec.shard.compress(layer, xt, refs)  # [T, r]
        storage.compress(slots, pos, codec.encode(latent), ref_slots, ref_pos)

    # -- reconstruct in decode: which compressed tokens a query reads -----------------
    def narrows_decode(self) -> bool:
        """Only a top-k narrows decode reads: with `deltakv_topk` 0 every query reads its
        whole view, and the host never asks for views (no per-layer, per-row calls)."""
        return bool(self.knobs.deltakv_topk)

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
        # Summed over this rank's query heads, then over the ranks'.
        score = batch.sparse.sum_over_ranks(torch.einsum("mhd,hgd->m", base, qf))  # [m]
        best = compressed[score.topk(topk).indices]
        keep = storage.is_full(view).clone()
        keep[best] = True
        return keep.nonzero().flatten()


def _padded(slots: torch.Tensor, width: int) -> torch.Tensor:
    """Center slots `[n]` -> `[width]`, the tail repeating the first (masked anyway)."""
    return torch.cat([slots, slots[:1].expand(width - slots.numel())])


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
