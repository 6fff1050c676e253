"""`int4` and `int2`: KIVI (Liu et al., 2024), on token slots that methods evict.

KIVI quantizes keys per channel over groups of G tokens (a few channels carry outliers
that a per-token scale would spread over the whole row) and values per token, both
asymmetrically (a scale and a zero point, kv/kivi_codes.py), and keeps the newest R
tokens of a sequence in full precision until a whole group can be quantized together.

What a slot holds (slot-major, moved by compaction, the radix cache and the tiers):

- `k`, `v`: uint8 `[num_slots, Hkv, D * bits / 8]`, the packed codes;
- `v_params`: float16 `[num_slots, Hkv, 2]`, the value's scale and zero point (per token
  and KV head);
- `state`: int32 `[num_slots]`: `g >= 0`, the slot is sealed in key group `g`; `-1`,
  empty; `<= -2`, a residual token whose K and V live in full precision in residual row
  `-state - 2`.

Shared by the slots:

- `key_groups`: float16 `[num_groups, Hkv, D, 2]`, each group's per-channel key scale and
  zero point, and `group_refs` `[num_groups]`, how many held slots were sealed in it
  (a group is free again when no slot references it: an evicted token leaves its
  group's parameters to the tokens that stay);
- `res_k`, `res_v`: the residual rows in the model dtype, handed out from a free stack
  that lives on the device (kv/free_stack.py), plus one spare row that padded rows of a
  store write to.

Who decides what to seal is the engine (engine/kv_seal.py): it knows each sequence's view
and seals the oldest G residual entries once more than R + G - 1 are there. A token is
written to a residual row when stored; `seal` quantizes a group; `release` (the pool
freeing slots) gives back residual rows and group references. `store` and `release` are
masked tensor operations without a host sync, so a decode step that stores into KIVI
layers is captured in a CUDA graph like any other (slot -1 pads a captured batch). Per-head compaction
re-quantizes the kept keys in new groups of the compacted order (their groups would
otherwise outlive all but a few of their tokens); values move exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sparsevllm.kv import kivi_codes as codes
from sparsevllm.kv.format import (
    FormatSizing,
    GroupsExhausted,
    KVFormat,
    KVPair,
    KVStorage,
    kv_zeros,
)
from sparsevllm.kv.free_stack import DeviceFreeStack

EMPTY = -1
# Tier rows name the key groups their rows reference with this prefix ("shared."): the
# buffers that are not one row per slot (engine/cache/disk_tier.py checks the others).
SHARED_GROUPS = "shared.key_groups"
# The key-group table holds this many groups per G slots (partial groups at sequence
# ends and after evictions), plus `extra_groups`.
GROUP_SLACK = 1.25


@dataclass(frozen=True)
class KiviFormat(KVFormat):
    """A KIVI format: `bits` per code, `group_size` (G) and `residual` (R) as in the
    paper; `residual_rows` and `extra_groups` are sized for the engine (`sized`)."""

    bits: int = 4
    group_size: int = 32
    residual: int = 128
    residual_rows: int = 0
    extra_groups: int = 0

    def sized(self, sizing: FormatSizing) -> KiviFormat:
        """Residual rows for every running sequence's newest R + G - 1 tokens, one step's
        new tokens (and the step launched ahead) and the scoring passes' scratch rows."""
        g, r = sizing.group_size, sizing.residual
        rows = sizing.max_num_seqs * (r + g) + sizing.max_step_tokens + sizing.scratch_rows
        return dataclasses.replace(
            self,
            group_size=g,
            residual=r,
            residual_rows=rows,
            extra_groups=2 * sizing.max_num_seqs + 8,
        )

    def bytes_per_slot(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        packed = 2 * num_kv_heads * head_dim * self.bits // 8
        value_params = num_kv_heads * 4
        group_bytes = num_kv_heads * head_dim * 4 + 4
        groups = math.ceil(GROUP_SLACK * group_bytes / self.group_size)
        return packed + value_params + 4 + groups  # + the slot's state

    def fixed_bytes(self, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> int:
        row = 2 * num_kv_heads * head_dim * model_dtype.itemsize + 8  # K, V, free-stack entry
        group_bytes = num_kv_heads * head_dim * 4 + 4
        return (self.residual_rows + 1) * row + self.extra_groups * group_bytes  # + the spare row

    def num_groups(self, num_slots: int) -> int:
        return math.ceil(GROUP_SLACK * num_slots / self.group_size) + self.extra_groups


class KiviStorage(KVStorage):
    """One layer's KIVI storage (module docstring)."""

    holds_residual = True
    tracks_frees = True

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
        assert isinstance(fmt, KiviFormat)
        self.kivi = fmt
        self.bits = fmt.bits
        h, d = num_kv_heads, head_dim
        self.k = kv_zeros((num_slots, h, d * self.bits // 8), torch.uint8, device)
        self.v = kv_zeros((num_slots, h, d * self.bits // 8), torch.uint8, device)
        self.v_params = kv_zeros((num_slots, h, 2), codes.PARAM_DTYPE, device)
        # One state entry past the slots: padded rows of a store (slot -1) write there.
        self._state = torch.full((num_slots + 1,), EMPTY, dtype=torch.int32, device=device)
        self.state = self._state[:num_slots]
        self._spare_slot = num_slots
        groups = fmt.num_groups(num_slots)
        self.key_groups = kv_zeros((groups, h, d, 2), codes.PARAM_DTYPE, device)
        self.group_refs = torch.zeros(groups, dtype=torch.int32, device=device)
        self._free_groups: list[int] = list(range(groups - 1, -1, -1))
        rows = max(fmt.residual_rows, 1)
        self.free_rows = DeviceFreeStack(rows, device)
        self.res_k = kv_zeros((rows + 1, h, d), dtype, device)  # + the spare row
        self.res_v = kv_zeros((rows + 1, h, d), dtype, device)

    @property
    def head_dim(self) -> int:
        return self.res_k.shape[2]

    @property
    def num_residual_free(self) -> int:
        """Free residual rows (waits for the device)."""
        return self.free_rows.num_free

    def buffers(self) -> dict[str, torch.Tensor]:
        """The slot-major buffers (the key groups and residual rows are shared state)."""
        return {"k": self.k, "v": self.v, "v_params": self.v_params, "state": self.state}

    def bytes_per_slot(self) -> int:
        return self.kivi.bytes_per_slot(self.num_kv_heads, self.head_dim, self.dtype)

    # -- residual rows and key groups ---------------------------------------------------
    def check_rows(self) -> None:
        """Raise if a store since the last check found no free residual row (called
        where the engine waits for the device anyway: sealing)."""
        short = self.free_rows.ran_dry()
        if short:
            raise RuntimeError(
                f"KIVI residual rows exhausted ({short} more asked than were free of "
                f"{self.free_rows.num_rows}); the engine sizes them for max_num_seqs x "
                "(R + G) + one step's tokens"
            )

    def take_groups(self, n: int) -> torch.Tensor:
        """`n` free key-group ids (reclaiming the groups no slot references any more);
        raises GroupsExhausted when there are not enough."""
        if n > len(self._free_groups):
            unused = (self.group_refs == 0).nonzero().flatten()
            self._free_groups = unused.tolist()[::-1]
        if n > len(self._free_groups):
            raise GroupsExhausted(f"{n} key groups asked, {len(self._free_groups)} free")
        taken = self._free_groups[len(self._free_groups) - n :]
        del self._free_groups[len(self._free_groups) - n :]
        return torch.tensor(taken, dtype=torch.long, device=self.device)

    def release(self, slots: torch.Tensor) -> None:
        """Slots `[n]` the pool freed: their residual rows and group references go back."""
        slots = slots.long()
        self._release(slots, torch.ones_like(slots, dtype=torch.bool))

    def _release(self, slots: torch.Tensor, real: torch.Tensor) -> None:
        """`release` of the `real` entries of `slots` `[n]` (the others index the spare
        state entry), in fixed-shape tensor operations."""
        st = self._state[slots]
        self.free_rows.give(-st.long() - 2, real & (st <= -2))
        drops = (real & (st >= 0)).to(torch.int32)
        self.group_refs.index_add_(0, st.clamp(min=0).long(), -drops)
        self._state.index_fill_(0, slots, EMPTY)  # no host scalar copied: capturable

    # -- writes -------------------------------------------------------------------------
    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """New tokens `[T, Hkv, D]` go to residual rows (an overwritten slot's old state
        is released); a slot of -1 is not stored. No host sync (module docstring)."""
        real = slots >= 0
        at = torch.where(real, slots.long(), self._spare_slot)  # [T]
        self._release(at, real)
        rows = self.free_rows.take(real)  # [T]: the spare row where not real
        self.res_k[rows] = k.to(self.dtype)
        self.res_v[rows] = v.to(self.dtype)
        self._state[at] = (-rows - 2).int()

    def seal(self, groups: torch.Tensor) -> None:
        """Quantize groups of slots `[n, G]` (-1: padding): each row's residual entries
        become one key group (per-channel parameters over them) and per-token values;
        entries that are sealed already are left as they are."""
        slots = groups.clamp(min=0).long()
        st = self.state[slots]
        valid = (groups >= 0) & (st <= -2)
        used = valid.any(1)
        if not bool(used.any()):
            return
        self.check_rows()
        slots, valid, st = slots[used], valid[used], st[used]
        rows = (-st.long() - 2).clamp(min=0)
        self._new_groups(slots, self.res_k[rows].float(), valid)  # keys [n, G, Hkv, D]
        self._write_values(slots[valid], self.res_v[rows[valid]].float())
        self.free_rows.give(rows.flatten(), valid.flatten())

    def _new_groups(self, slots: torch.Tensor, kf: torch.Tensor, valid: torch.Tensor) -> None:
        """Quantize keys `kf` `[n, G, Hkv, D]` (float32) of slots `[n, G]` where `valid`
        `[n, G]`: row i's valid entries become one new key group."""
        gids = self.take_groups(slots.shape[0])
        par = codes.group_params(kf, valid, self.bits)  # [n, Hkv, D, 2]
        self.key_groups[gids] = par
        self.group_refs[gids] = valid.sum(1).int()
        q = codes.quantize(kf, par.unsqueeze(1), self.bits)[valid]
        self.k[slots[valid]] = codes.pack(q, self.bits)
        self.state[slots[valid]] = gids.unsqueeze(1).expand_as(slots)[valid].int()

    def _write_values(self, slots: torch.Tensor, vf: torch.Tensor) -> None:
        """Quantize values `[n, Hkv, D]` (float32) per token into `slots` `[n]`."""
        par = codes.token_params(vf, self.bits)
        self.v_params[slots] = par
        self.v[slots] = codes.pack(codes.quantize_tokens(vf, par, self.bits), self.bits)

    # -- reads --------------------------------------------------------------------------
    def _rows(self, slots: torch.Tensor, heads: torch.Tensor | None, keys: bool) -> torch.Tensor:
        """Float32 keys or values of slots `[n]` (every head: `[n, Hkv, D]`) or of
        per-head slots `[B, Hkv]` with `heads` `[Hkv]` (`[B, Hkv, D]`)."""
        st = self.state[slots].long()  # [n] or [B, Hkv]
        gid, row = st.clamp(min=0), (-st - 2).clamp(min=0)

        def at(index: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return (index,) if heads is None else (index, heads)

        if keys:
            packed = codes.unpack(self.k[at(slots)], self.bits)
            quant = codes.dequantize(packed, self.key_groups[at(gid)])
            full = self.res_k[at(row)]
        else:
            packed = codes.unpack(self.v[at(slots)], self.bits)
            quant = codes.dequantize_tokens(packed, self.v_params[at(slots)])
            full = self.res_v[at(row)]
        state = st.view(*st.shape, *([1] * (quant.dim() - st.dim())))
        out = torch.where(state >= 0, quant, full.float())
        return torch.where(state == EMPTY, torch.zeros_like(out), out)

    def _read(self, slots: torch.Tensor, keys: bool) -> torch.Tensor:
        flat = slots.reshape(-1).long()
        out = self._rows(flat, None, keys).to(self.dtype)
        return out.view(*slots.shape, *out.shape[1:])

    def read_keys(self, slots: torch.Tensor) -> torch.Tensor:
        return self._read(slots, keys=True)

    def read_values(self, slots: torch.Tensor) -> torch.Tensor:
        return self._read(slots, keys=False)

    def read_head_keys(self, slots: torch.Tensor, head: int) -> torch.Tensor:
        return self.read_keys(slots)[:, head]

    def read_heads(self, slots: torch.Tensor) -> KVPair:
        heads = torch.arange(slots.shape[1], device=slots.device)
        slots = slots.long()
        k = self._rows(slots, heads, keys=True).to(self.dtype)
        return k, self._rows(slots, heads, keys=False).to(self.dtype)

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError("KIVI storage dequantizes through read_keys / read_values")

    def residual_tail(self, slots: torch.Tensor) -> int:
        """How many trailing entries of a view `[L]` are residual tokens."""
        residual = (self.state[slots.long()] <= -2).flip(0)
        return int(residual.int().cumprod(0).sum())

    # -- moves --------------------------------------------------------------------------
    def compact_heads(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Head h of slot `dst[j]` takes head h of slot `src[j, h]` (`[B, Hkv]`, `[B]`).

        The trailing rows whose every head is residual stay residual (copied in full
        precision); the rows before them are sealed: values keep their codes (a residual
        one is quantized now) and keys are re-quantized in groups of G over the compacted
        order, so that no group outlives most of its tokens. The caller frees the
        source slots outside `dst` afterwards (their residual rows and references go
        back then); `dst`'s old state is released here."""
        src, dst = src.long(), dst.long()
        heads = torch.arange(src.shape[1], device=src.device)
        residual = self.state[src] <= -2  # [B, Hkv]
        tail = int(residual.all(1).flip(0).int().cumprod(0).sum())
        sealed = src.shape[0] - tail
        kf = self._rows(src, heads, keys=True)  # [B, Hkv, D] float32
        vf = self._rows(src, heads, keys=False)
        v_codes, v_par = self.v[src, heads], self.v_params[src, heads]
        self.release(dst)
        if sealed:
            self._regroup_keys(dst[:sealed], kf[:sealed])
            fresh = residual[:sealed, :, None]  # [n, Hkv, 1]: values to quantize now
            par = codes.token_params(vf[:sealed], self.bits)
            new = codes.pack(codes.quantize_tokens(vf[:sealed], par, self.bits), self.bits)
            self.v[dst[:sealed]] = torch.where(fresh, new, v_codes[:sealed])
            self.v_params[dst[:sealed]] = torch.where(fresh, par, v_par[:sealed])
        if tail:
            rows = self.free_rows.take(torch.ones(tail, dtype=torch.bool, device=self.device))
            self.res_k[rows] = kf[sealed:].to(self.dtype)
            self.res_v[rows] = vf[sealed:].to(self.dtype)
            self.state[dst[sealed:]] = (-rows - 2).int()

    def _regroup_keys(self, slots: torch.Tensor, kf: torch.Tensor) -> None:
        """Quantize keys `[n, Hkv, D]` (float32) into `slots` `[n]`, G consecutive slots
        to a new group."""
        n, g = kf.shape[0], self.kivi.group_size
        num = math.ceil(n / g)
        padded = torch.zeros((num * g, *kf.shape[1:]), dtype=kf.dtype, device=kf.device)
        padded[:n] = kf
        grid = torch.zeros(num * g, dtype=torch.long, device=kf.device)
        grid[:n] = slots
        valid = (torch.arange(num * g, device=kf.device) < n).view(num, g)
        self._new_groups(grid.view(num, g), padded.view(num, g, *kf.shape[1:]), valid)

    def gather_rows(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `slots` `[n]` in the stored form plus their key groups: `state` holds
        each row's index into `shared.key_groups` `[m, Hkv, D, 2]`."""
        st = self.state[slots].long()
        if bool((st < 0).any()):
            raise RuntimeError(
                "KIVI rows leave the pool sealed (the engine seals a view before the cache "
                "adopts it); these hold residual or empty slots"
            )
        gids, local = first_seen(st)
        rows = {name: buf[slots] for name, buf in self.buffers().items()}
        rows["state"] = local.int()
        rows[SHARED_GROUPS] = self.key_groups[gids]
        return rows

    def scatter_rows(self, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write `gather_rows`' rows back at `slots` (new groups, the same bytes)."""
        expected = {*self.buffers(), SHARED_GROUPS}
        if rows.keys() != expected:
            raise ValueError(
                f"KV rows hold {sorted(rows)}, but {self.format.name} storage has {sorted(expected)}"
            )
        slots = slots.long()
        self.release(slots)
        groups = rows[SHARED_GROUPS].to(self.device)
        local = rows["state"].to(self.device).long()
        gids = self.take_groups(groups.shape[0])
        self.key_groups[gids] = groups
        self.group_refs[gids] = torch.bincount(local, minlength=groups.shape[0]).int()
        for name in ("k", "v", "v_params"):
            self.buffers()[name][slots] = rows[name].to(self.device)
        self.state[slots] = gids[local].int()


def first_seen(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of `ids` `[n]` in order of first appearance, and each entry's
    index among them (the same rows give the same numbering wherever they live)."""
    uniq, inverse = torch.unique(ids, return_inverse=True)
    n = ids.numel()
    first = torch.full((uniq.numel(),), n, dtype=torch.long, device=ids.device)
    first.scatter_reduce_(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=ids.device)
    return uniq[order], rank[inverse]


def _kivi(bits: int) -> KiviFormat:
    return KiviFormat(
        name=f"int{bits}",
        help=f"KIVI {bits}-bit codes: keys per channel over groups of "
        "kv_quant_group_size tokens, values per token, the newest kv_quant_residual "
        "tokens in full precision",
        element_dtype=torch.uint8,
        scaled=False,
        factory=KiviStorage,
        stores_shared_kv=False,  # per-channel key groups of per-head K and V
        # Packed codes and shared key groups: the torch reference reads them (on CUDA
        # too) until the Triton attention kernels do.
        kernels="kivi",
        bits=bits,
    )


INT4 = _kivi(4)
INT2 = _kivi(2)
