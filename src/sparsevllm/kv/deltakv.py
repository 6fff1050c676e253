"""DeltaKV's storage: latent residuals in the slots, full-precision K/V in shared rows.

The `deltakv` sparse method (sparse/deltakv.py) brings this format for its layers
(`SparseMethod.storage_format`); it is never a `kv_cache_dtype` of its own. A slot is one
token of one layer, as in every format, but what it holds depends on the token:

- a *full* token (sink, center, or still in its sequence's recent window) owns a row of
  the shared full-precision table (`full_k`, `full_v`: the K/V as computed, keys
  post-RoPE, in the model dtype);
- a *compressed* token holds its latent code (opaque bytes the method's codec wrote:
  INT4 codes plus their scale/zero, or float16 values) and the full rows of its R
  references; its own full row went back to the table when it was compressed.

Slot-major buffers (moved by the radix cache's sharing and by the tiers):

- `latent`: uint8 `[num_slots, latent_bytes]`, a compressed token's code;
- `refs`: int32 `[num_slots, R]`, the full rows of its references;
- `state`: int32 `[num_slots]`: `>= 0` the full row the token owns; `-1` empty; `-2`
  compressed;
- `pos`: int32 `[num_slots]`, a compressed token's position (its key is rotated back to
  it on reconstruction).

Shared state: the full rows, each with its position (`row_pos`, for un-rotating a
reference key) and a reference count (`row_refs`: the slot that owns it plus every
compressed token that refers to it), so a center evicted with its slot (a finished
request's KV freed, a radix node dropped) stays while tokens still refer to it.

Reads of compressed tokens are reconstructed by a decoder the method attaches
(`attach_decoder`): the storage hands it the codes and the references' full rows, and it
returns post-RoPE K and V. The storage itself knows nothing of the compressor.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from sparsevllm.kv.format import (
    SHARED_PREFIX,
    FormatSizing,
    KVFormat,
    KVPair,
    KVStorage,
    kv_zeros,
)
from sparsevllm.kv.free_stack import DeviceFreeStack
from sparsevllm.kv.kivi import first_seen

EMPTY = -1
COMPRESSED = -2
# Tier rows carry the full rows their slots refer to under these names (kv/format.py).
SHARED_K = SHARED_PREFIX + "full_k"
SHARED_V = SHARED_PREFIX + "full_v"
SHARED_POS = SHARED_PREFIX + "row_pos"
# Full rows per slot beyond the fixed recent-window rows: the centers (1 / stride of the
# slots) with room for partial strides at sequence ends and the sinks of cached entries.
CENTER_SLACK = 1.5


@dataclass(frozen=True)
class UpMap:
    """What a kernel needs to reconstruct a layer's compressed tokens in registers: the
    linear up map and how the codes and keys are laid out."""

    weight: torch.Tensor  # [2 * Hkv * D, r]: K rows, then V rows (this rank's heads)
    bias: torch.Tensor | None  # [2 * Hkv * D]
    freqs: torch.Tensor | None  # [D / 2] float32 RoPE frequencies (None: no RoPE)
    bits: int  # 4: r / 2 INT4 code bytes, then a float16 scale and zero; 16: float16 values
    # The decode kernel that reads it (the method's deltakv_decode_kernel): "fused"
    # rebuilds tiles where it scores them, "rebuild" rebuilds the views into a dense
    # scratch for the dense decode kernel.
    kernel: str


class LatentDecoder(Protocol):
    """What the method attaches to a layer's storage to read compressed tokens."""

    def up_map(self, dtype: torch.dtype) -> UpMap | None:
        """The layer's up map for a pool of `dtype` (None: not linear, or the method
        chose the materialising path, so no kernel reconstructs in registers and reads
        go through `decode`)."""
        ...

    def decode(
        self,
        codes: torch.Tensor,  # [n, latent_bytes] uint8 (a layer may use a prefix)
        full_k: torch.Tensor,  # [rows, Hkv, D] the full rows (post-RoPE keys)
        full_v: torch.Tensor,  # [rows, Hkv, D]
        refs: torch.Tensor,  # [n, R] int64: each token's reference rows
        row_pos: torch.Tensor,  # [rows] int32: each row's position
        pos: torch.Tensor,  # [n] int64
    ) -> KVPair:  # K (post-RoPE at pos), V: [n, Hkv, D] float32
        ...


@dataclass(frozen=True)
class DeltaKVFormat(KVFormat):
    """The storage of one DeltaKV compressor under one set of budgets (built by the
    method from its checkpoint and knobs; `sized` adds the engine's limits)."""

    latent_bytes: int = 0
    num_references: int = 4
    center_stride: int = 10
    full_tokens_per_seq: int = 0  # sink + recent window + one stride, per running sequence
    fixed_rows: int = 0

    def sized(self, sizing: FormatSizing) -> DeltaKVFormat:
        """Full rows for every running sequence's sink and recent window, one step's new
        tokens and the scoring passes' scratch rows (beside the centers' share)."""
        rows = (
            sizing.max_num_seqs * self.full_tokens_per_seq
            + sizing.max_step_tokens
            + sizing.scratch_rows
        )
        return dataclasses.replace(self, fixed_rows=rows)

    def _full_row_bytes(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * dtype.itemsize + 8  # + row_pos, row_refs

    def bytes_per_slot(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """A slot's code, references, state and position, plus its share of center rows."""
        own = self.latent_bytes + 4 * self.num_references + 4 + 4
        row = self._full_row_bytes(num_kv_heads, head_dim, model_dtype)
        return own + math.ceil(CENTER_SLACK * row / self.center_stride)

    def fixed_bytes(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        return self.fixed_rows * self._full_row_bytes(num_kv_heads, head_dim, model_dtype)

    def num_rows(self, num_slots: int) -> int:
        return math.ceil(CENTER_SLACK * num_slots / self.center_stride) + self.fixed_rows


class DeltaKVStorage(KVStorage):
    """One layer's DeltaKV storage (module docstring)."""

    tracks_frees = True  # a freed slot gives back its full row or its references

    def __init__(
        self,
        fmt: KVFormat,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(fmt, dtype)
        assert isinstance(fmt, DeltaKVFormat)
        self.delta = fmt
        self.latent = kv_zeros((num_slots, max(fmt.latent_bytes, 1)), torch.uint8, device)
        # One entry past the slots: a store's padded rows (slot -1) release and write
        # there, so a store is the same tensor operations whatever rows are real.
        self._refs = torch.zeros(
            (num_slots + 1, fmt.num_references), dtype=torch.int32, device=device
        )
        self.refs = self._refs[:num_slots]
        self._state = torch.full((num_slots + 1,), EMPTY, dtype=torch.int32, device=device)
        self.state = self._state[:num_slots]
        self._spare_slot = num_slots
        self.pos = torch.zeros(num_slots, dtype=torch.int32, device=device)
        rows = max(fmt.num_rows(num_slots), 1)
        # Full rows come from a stack on the device (kv/free_stack.py): storing and
        # compressing never wait for the device. The spare row past them absorbs masked
        # writes (padded store rows, tokens a compression leaves as they are).
        self.free_rows = DeviceFreeStack(rows, device)
        self._spare_row = rows
        self.full_k = kv_zeros((rows + 1, num_kv_heads, head_dim), dtype, device)
        self.full_v = kv_zeros((rows + 1, num_kv_heads, head_dim), dtype, device)
        self.row_pos = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.row_refs = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._mark = torch.zeros(rows + 1, dtype=torch.long, device=device)  # _unref's scratch
        self.decoder: LatentDecoder | None = None

    # -- shape ----------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.state.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.full_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.full_k.shape[2]

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def num_rows(self) -> int:
        """Full rows the storage hands out (the spare row aside)."""
        return self.free_rows.num_rows

    @property
    def num_rows_free(self) -> int:
        """Free full rows (waits for the device)."""
        return self.free_rows.num_free

    def buffers(self) -> dict[str, torch.Tensor]:
        """The slot-major buffers (the full rows are shared state)."""
        return {"latent": self.latent, "refs": self.refs, "state": self.state, "pos": self.pos}

    def bytes_per_slot(self) -> int:
        return self.delta.bytes_per_slot(self.num_kv_heads, self.head_dim, self.dtype)

    def attach_decoder(self, decoder: LatentDecoder) -> None:
        self.decoder = decoder

    # -- full rows ------------------------------------------------------------------------
    def check_rows(self) -> None:
        """Raise if a store since the last check found no free full row (called where
        the host waits for the device anyway: a method's next step)."""
        short = self.free_rows.ran_dry()
        if short:
            raise RuntimeError(
                f"DeltaKV full-precision rows exhausted ({short} more asked than were free "
                f"of {self.num_rows}): they are sized for max_num_seqs x (sink + recent + "
                f"stride) + one step's tokens + {CENTER_SLACK} / stride of the slots; lower "
                "recent_keep_tokens or max_num_seqs"
            )

    def _unref(self, rows: torch.Tensor, drop: torch.Tensor) -> None:
        """Drop one reference at `rows[i]` for every True `drop[i]` (`[n]`); rows no one
        holds any more go back to the stack, each once. Fixed-shape tensor operations."""
        if not rows.numel():
            return
        rows = torch.where(drop, rows.long(), self._spare_row)
        self.row_refs.index_add_(0, rows, -drop.to(torch.int32))
        # A row listed several times is given back by one entry: the one whose index the
        # scatter kept (any one of them, but exactly one).
        idx = torch.arange(rows.numel(), device=rows.device)
        self._mark.scatter_(0, rows, idx)
        keep = drop & (self._mark[rows] == idx) & (self.row_refs[rows] == 0)
        self.free_rows.give(rows, keep)

    def _ref(self, rows: torch.Tensor, add: torch.Tensor) -> None:
        """One more reference at `rows[i]` for every True `add[i]` (any shape)."""
        rows, add = rows.reshape(-1).long(), add.reshape(-1)
        self.row_refs.index_add_(0, torch.where(add, rows, self._spare_row), add.to(torch.int32))

    def release(self, slots: torch.Tensor) -> None:
        """Slots `[n]` the pool freed: their own rows and references go back."""
        slots = slots.long()
        self._release(slots, torch.ones_like(slots, dtype=torch.bool))

    def _release(self, slots: torch.Tensor, real: torch.Tensor) -> None:
        """`release` of the `real` entries of `slots` `[n]` (the others index the spare
        slot): a full token's row, a compressed token's references."""
        st = self._state[slots]  # [n]
        refs = self._refs[slots].long()  # [n, R]
        compressed = (real & (st == COMPRESSED))[:, None].expand_as(refs)
        rows = torch.cat([st.long().clamp(min=0), refs.reshape(-1)])
        self._unref(rows, torch.cat([real & (st >= 0), compressed.reshape(-1)]))
        self._state.index_fill_(0, slots, EMPTY)

    # -- writes ---------------------------------------------------------------------------
    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """New tokens `[T, Hkv, D]` go to full rows (a reused slot's old state is
        released first); a slot of -1 is not stored. No host sync."""
        real = slots >= 0
        at = torch.where(real, slots.long(), self._spare_slot)  # [T]
        self._release(at, real)
        rows = self.free_rows.take(real)  # [T]: the spare row where not real
        self.full_k[rows] = k.to(self.dtype)
        self.full_v[rows] = v.to(self.dtype)
        self.row_refs.index_fill_(0, rows, 1)  # no host scalar copy: a captured store
        self._state[at] = rows.int()

    def is_full(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool `[n]`: which of `slots` hold their K/V in a full row."""
        return self.state[slots.long()] >= 0

    def compress(
        self,
        slots: torch.Tensor,  # [n] tokens to compress
        positions: torch.Tensor,  # [n]
        codes: torch.Tensor,  # [n, <= latent_bytes] uint8
        ref_slots: torch.Tensor,  # [n, R] full tokens they refer to
        ref_positions: torch.Tensor,  # [n, R]
    ) -> None:
        """Replace full tokens by their codes against references held in full rows.
        A token that is not full (compressed already: a restored view compresses its
        window before the method sees it) or has a reference that is not is left as it
        is: masked tensor operations, so the host never waits to find out which."""
        slots, ref_slots = slots.long(), ref_slots.long()
        own = self.state[slots].long()  # [n]
        ref_rows = self.state[ref_slots].long()  # [n, R]
        ok = (own >= 0) & (ref_rows >= 0).all(dim=-1)  # [n]
        okr = ok[:, None].expand_as(ref_rows)
        self._ref(ref_rows, okr)
        at = torch.where(okr, ref_rows, self._spare_row).reshape(-1)
        self.row_pos[at] = ref_positions.reshape(-1).to(torch.int32)
        # A layer narrower than the widest (the format's width) fills a prefix.
        width = codes.shape[1]
        m = ok[:, None]
        self.latent[slots, :width] = torch.where(m, codes, self.latent[slots, :width])
        self.refs[slots] = torch.where(m, ref_rows.int(), self.refs[slots])
        self.pos[slots] = torch.where(ok, positions.int(), self.pos[slots])
        self.state[slots] = torch.where(ok, COMPRESSED, self.state[slots])
        self._unref(own.clamp(min=0), ok)

    # -- reads ----------------------------------------------------------------------------
    def read(self, slots: torch.Tensor) -> KVPair:
        """K and V at slot ids `[...]` (compressed tokens reconstructed): `[..., Hkv, D]`."""
        flat = slots.reshape(-1).long()
        st = self.state[flat]
        rows = st.clamp(min=0)
        k = self.full_k[rows]  # [n, Hkv, D] (a copy: advanced indexing)
        v = self.full_v[rows]
        packed = (st == COMPRESSED).nonzero().flatten()
        if packed.numel():
            rk, rv = self._reconstruct(flat[packed])
            k[packed], v[packed] = rk.to(self.dtype), rv.to(self.dtype)
        empty = (st == EMPTY)[:, None, None]
        k, v = k.masked_fill(empty, 0), v.masked_fill(empty, 0)
        shape = (*slots.shape, *k.shape[1:])
        return k.view(shape), v.view(shape)

    def read_full(self, slots: torch.Tensor) -> KVPair:
        """K and V `[..., Hkv, D]` of slots the caller knows to hold full rows (centers,
        or tokens a masked compression skips where they are not): `read` without
        finding out on the host which slots need reconstructing."""
        rows = self.state[slots.long()].clamp(min=0)
        return self.full_k[rows], self.full_v[rows]

    def _reconstruct(self, slots: torch.Tensor) -> KVPair:
        """Post-RoPE K, V `[n, Hkv, D]` float32 of compressed slots `[n]`."""
        if self.decoder is None:
            raise RuntimeError("DeltaKV storage read before the method attached its decoder")
        refs = self.refs[slots].long()  # [n, R]
        # The tables whole, not the gathered references: a kernel reads the rows itself.
        codes, pos = self.latent[slots], self.pos[slots].long()
        return self.decoder.decode(codes, self.full_k, self.full_v, refs, self.row_pos, pos)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self.read(slots)[0]

    def read_values(self, slots: torch.Tensor) -> torch.Tensor:
        return self.read(slots)[1]

    def read_head_keys(self, slots: torch.Tensor, head: int) -> torch.Tensor:
        return self.read_keys(slots)[:, head]

    def read_heads(self, slots: torch.Tensor) -> KVPair:
        k, v = self.read(slots)  # [B, Hkv, Hkv, D]: every head of every picked slot
        heads = torch.arange(slots.shape[1], device=slots.device)
        return k[:, heads, heads], v[:, heads, heads]

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError("DeltaKV storage reconstructs through read")

    # -- moves ----------------------------------------------------------------------------
    def compact_heads(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError(
            "DeltaKV storage keeps every token (no per-head compaction): its method never "
            "evicts, and pruning a DeltaKV history is refused"
        )

    def gather_rows(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `slots` `[n]` in the stored form plus the full rows they hold or refer
        to (`shared.*`, renumbered in order of first use): `state` and `refs` index them."""
        slots = slots.long()
        st = self.state[slots].long()
        if bool((st == EMPTY).any()):
            raise RuntimeError("DeltaKV rows leave the pool stored; these hold empty slots")
        compressed = st == COMPRESSED
        refs = self.refs[slots].long()  # [n, R]
        # Every row the entry needs: a full token's own, a compressed token's references.
        wanted = torch.where(compressed[:, None], refs, st[:, None].expand_as(refs))
        rows, local = first_seen(wanted.reshape(-1))
        local = local.view_as(wanted)
        out = {name: buf[slots] for name, buf in self.buffers().items()}
        out["state"] = torch.where(compressed, COMPRESSED, local[:, 0]).int()
        out["refs"] = torch.where(compressed[:, None], local, 0).int()
        out[SHARED_K], out[SHARED_V] = self.full_k[rows], self.full_v[rows]
        out[SHARED_POS] = self.row_pos[rows]
        return out

    def scatter_rows(self, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write `gather_rows`' rows back at `slots` (fresh full rows, the same bytes)."""
        expected = {*self.buffers(), SHARED_K, SHARED_V, SHARED_POS}
        if rows.keys() != expected:
            raise ValueError(
                f"KV rows hold {sorted(rows)}, but DeltaKV storage has {sorted(expected)}"
            )
        slots = slots.long()
        self.release(slots)
        num = rows[SHARED_K].shape[0]
        if num > self.free_rows.num_free:  # a restore waits for the device anyway
            raise RuntimeError(
                f"DeltaKV full-precision rows exhausted restoring {num} rows "
                f"({self.free_rows.num_free} free of {self.num_rows})"
            )
        fresh = self.free_rows.take(torch.ones(num, dtype=torch.bool, device=self.device))
        self.full_k[fresh] = rows[SHARED_K].to(self.device, self.dtype)
        self.full_v[fresh] = rows[SHARED_V].to(self.device, self.dtype)
        self.row_pos[fresh] = rows[SHARED_POS].to(self.device)
        state = rows["state"].to(self.device).long()
        compressed = state == COMPRESSED
        refs = fresh[rows["refs"].to(self.device).long()]  # [n, R]
        self.row_refs[fresh] = 0
        held = torch.cat([fresh[state[~compressed]], refs[compressed].reshape(-1)])
        self._ref(held, torch.ones_like(held, dtype=torch.bool))
        self.latent[slots] = rows["latent"].to(self.device)
        self.pos[slots] = rows["pos"].to(self.device)
        self.refs[slots] = torch.where(compressed[:, None], refs, 0).int()
        self.state[slots] = torch.where(compressed, COMPRESSED, fresh[state.clamp(min=0)]).int()
        self.free_rows.give(fresh, self.row_refs[fresh] == 0)


def deltakv_format(
    latent_bytes: int, num_references: int, center_stride: int, full_tokens_per_seq: int
) -> DeltaKVFormat:
    """The format a DeltaKV method stores its layers in (module docstring)."""
    return DeltaKVFormat(
        name="deltakv",
        help="DeltaKV: latent residuals against full-precision centers (sparse_method "
        "deltakv brings it; never chosen with kv_cache_dtype)",
        element_dtype=torch.uint8,
        scaled=False,
        factory=DeltaKVStorage,
        stores_shared_kv=False,
        # Latent codes and shared full rows: the torch reference reads them, on the CPU
        # and on CUDA (tests/gpu/test_deltakv_cuda.py).
        kernels="deltakv",
        latent_bytes=latent_bytes,
        num_references=num_references,
        center_stride=center_stride,
        full_tokens_per_seq=full_tokens_per_seq,
    )
