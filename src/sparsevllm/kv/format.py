"""The storage-format interface: one `KVFormat` per `kv_cache_dtype`, one `KVStorage`
per layer.

A format decides how one token's K and V of one layer are laid out and how they are
written (quantize on store) and read back (dequantize). The pool and everything above
it see only slots: every buffer of a storage is slot-major, `[num_slots, Hkv, ...]`,
so that

* per-KV-head compaction copies row `[src[j, h], h]` of every buffer to `[dst[j], h]`
  (scales travel with their values, nothing is re-quantized);
* the radix cache shares slots, and with them every byte that describes them;
* the host and disk tiers move a token by moving its rows of every buffer, in the
  stored form (an INT8 chain moves about half of a bf16 chain's bytes).

Readers that want values (scores, Quest's page summaries, pruning, the torch reference
attention) call `read` / `read_keys` / `read_heads` and get the compute dtype back;
kernels read the buffers themselves and dequantize in registers.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

KVPair = tuple[torch.Tensor, torch.Tensor]


class GroupsExhausted(RuntimeError):
    """A format's shared groups (KIVI's key groups) are all referenced: the engine
    re-groups the running views (`compact_heads` in place) and tries again."""


class KVStorage(abc.ABC):
    """One layer's K and V in one format.

    `k` and `v` hold the stored elements `[num_slots, Hkv, D]` (the model dtype, or a
    quantized dtype); `k_scale` / `v_scale` are `[num_slots, Hkv]` float32 per-token,
    per-head scales where the format has them, else None.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    # Whether the newest tokens of a sequence wait in full precision until the engine
    # seals them (`seal`; KIVI's residual window, kv/kivi.py and engine/kv_seal.py).
    holds_residual = False
    # Whether the storage keeps state beside its slots that the pool's frees must reach
    # (`release`): KIVI's residual rows and key groups, DeltaKV's shared full rows.
    tracks_frees = False

    def __init__(self, fmt: KVFormat, dtype: torch.dtype) -> None:
        self.format = fmt
        self.dtype = dtype  # the compute dtype that reads return

    # -- what a format defines --------------------------------------------------------
    @abc.abstractmethod
    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write new tokens' `k`, `v` `[T, Hkv, D]` into `slots` `[T]` (-1: skip)."""

    @abc.abstractmethod
    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Values of stored elements `[..., D]` with their scales `[...]`, compute dtype."""

    # -- shared by every slot-major format --------------------------------------------
    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name; each is `[num_slots, Hkv, ...]`."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None and self.v_scale is not None:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        return out

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]

    @property
    def device(self) -> torch.device:
        return self.k.device

    def read(self, slots: torch.Tensor) -> KVPair:
        """K and V at slot ids `[...]`: `[..., Hkv, D]` in the compute dtype."""
        return self.read_keys(slots), self.read_values(slots)

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self.dequantize(rows_at(self.k, slots), _at(self.k_scale, slots))

    def read_values(self, slots: torch.Tensor) -> torch.Tensor:
        return self.dequantize(rows_at(self.v, slots), _at(self.v_scale, slots))

    def read_head_keys(self, slots: torch.Tensor, head: int) -> torch.Tensor:
        """Keys of one KV head at slot ids `[L]`: `[L, D]` in the compute dtype."""
        scale = None if self.k_scale is None else self.k_scale[slots, head]
        return self.dequantize(self.k[slots, head], scale)

    def read_heads(self, slots: torch.Tensor) -> KVPair:
        """Per-head slots `[B, Hkv]` (head h reads `slots[:, h]`): K, V `[B, Hkv, D]`."""
        heads = torch.arange(slots.shape[1], device=slots.device)
        k_scale = None if self.k_scale is None else self.k_scale[slots, heads]
        v_scale = None if self.v_scale is None else self.v_scale[slots, heads]
        return (
            self.dequantize(self.k[slots, heads], k_scale),
            self.dequantize(self.v[slots, heads], v_scale),
        )

    def compact_heads(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row j of head h moves from slot `src[j, h]` to slot `dst[j]` (`src` `[B, Hkv]`,
        `dst` `[B]`), stored bytes and scales alike: exact in every format."""
        heads = torch.arange(src.shape[1], device=src.device)
        for buf in self.buffers().values():
            buf[dst] = buf[src, heads]  # the right side is a copy: src and dst may overlap

    def gather_rows(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every buffer's rows at `slots` `[n]`, in the stored form (for the tiers)."""
        return {name: buf[slots] for name, buf in self.buffers().items()}

    def scatter_rows(self, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write rows `gather_rows` returned back at `slots` (bit-exact)."""
        buffers = self.buffers()
        if rows.keys() != buffers.keys():
            raise ValueError(
                f"KV rows hold {sorted(rows)}, but {self.format.name} storage has {sorted(buffers)}"
            )
        for name, buf in buffers.items():
            buf[slots] = rows[name].to(buf.device)

    def seal(self, groups: torch.Tensor) -> None:
        """Quantize the residual entries of slot groups `[n, G]` (-1: padding); only
        formats that hold a residual have any."""
        raise NotImplementedError(f"{self.format.name} storage holds no residual tokens")

    def release(self, slots: torch.Tensor) -> None:
        """The pool freed `slots` `[n]`: drop what the storage keeps for them beside
        their rows (nothing, in a slot-only format)."""
        return None

    def residual_tail(self, slots: torch.Tensor) -> int:
        """How many trailing entries of a view `[L]` are residual tokens."""
        return 0

    def bytes_per_slot(self) -> int:
        """Bytes one token takes in this layer (every buffer's row)."""
        return sum(b[0].numel() * b.element_size() for b in self.buffers().values())


def _at(scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor | None:
    return None if scale is None else rows_at(scale, slots)


def rows_at(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`buf[slots]` for slot ids `[...]` (non-negative): `[..., *buf.shape[1:]]`. Through
    `index_select`, which on the CPU gathers a few hundred rows 4-25x faster than advanced
    indexing (the reference backend reads every view this way)."""
    flat = buf.index_select(0, slots.reshape(-1))
    return flat.view(*slots.shape, *buf.shape[1:])


# Tier rows whose name starts with this are a format's shared state (e.g. KIVI's key
# groups), not one row per slot.
SHARED_PREFIX = "shared."


@dataclass(frozen=True)
class FormatSizing:
    """What a format with state beside its slots sizes that state for: its knobs and
    the engine's limits."""

    group_size: int  # KIVI's G: tokens per key group
    residual: int  # KIVI's R: newest tokens kept in full precision
    max_num_seqs: int
    max_step_tokens: int  # new tokens one step stores (max_num_batched_tokens)
    scratch_rows: int  # scoring passes' rows beside the pool


StorageFactory = Callable[["KVFormat", int, int, int, torch.dtype, torch.device], KVStorage]


@dataclass(frozen=True)
class KVFormat:
    """A `kv_cache_dtype`: its name, what it stores, and how to build a layer's storage.

    `element_dtype` is the stored element type (None: the model dtype); `scaled` formats
    add one float32 scale per token and KV head for K and for V.
    """

    name: str
    help: str
    element_dtype: torch.dtype | None
    scaled: bool
    factory: StorageFactory
    # Devices whose kernels read the format ("cpu": the torch reference; "cuda": Triton).
    devices: tuple[str, ...] = ("cpu", "cuda")
    # Lowest CUDA compute capability whose Triton kernels convert the element type.
    min_cuda_capability: tuple[int, int] = (0, 0)
    # Whether the format stores a shared-KV layout (MLA's latent row) as well.
    stores_shared_kv: bool = True
    # What a kernel reads: "elementwise" (one element per channel, at most a scale per
    # token and head: the Triton kernels), or the name of another kernel family.
    kernels: str = "elementwise"

    @property
    def is_model_dtype(self) -> bool:
        return self.element_dtype is None

    def bytes_per_slot(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in one layer, scales included."""
        elem = torch.empty((), dtype=self.element_dtype or model_dtype).element_size()
        per_head = head_dim * elem + (4 if self.scaled else 0)
        return 2 * num_kv_heads * per_head

    def fixed_bytes(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes one layer's storage holds beside its slots (none for slot-only formats)."""
        return 0

    def sized(self, sizing: FormatSizing) -> KVFormat:
        """This format with its state sized for an engine (slot-only formats: itself)."""
        return self

    def create(
        self,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVStorage:
        return self.factory(self, num_slots, num_kv_heads, head_dim, dtype, device)

    def usable_on(self, device: torch.device) -> bool:
        if device.type not in self.devices:
            return False
        if device.type == "cuda":
            return torch.cuda.get_device_capability(device) >= self.min_cuda_capability
        return True


def real_rows(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a store whose slot is real: a slot of -1 marks a row that is not
    written. `k`/`v` `[T, ...]`, `slots` `[T]`."""
    keep = slots >= 0
    if bool(keep.all()):
        return k, v, slots
    return k[keep], v[keep], slots[keep]


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV tensor. On the CPU its memory comes from numpy's calloc, whose
    pages the OS maps zeroed on first touch: torch.zeros would write the whole pool at
    start (a second per GiB here) although a request touches only the slots it uses."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # Same-size integer storage, reinterpreted: all-zero bits are 0 in every dtype.
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize]
    return torch.from_numpy(np.zeros(shape, dtype=bits)).view(dtype)
