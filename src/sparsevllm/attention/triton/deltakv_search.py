"""DeltaKV's center search at decode, reading the centers' full rows in place.

At every decode step each sequence compresses one token against its `num_references`
nearest earlier centers, in squared L2 over the compressor's vectors (keys turned back
to pre-RoPE, joined with the values, float32: `TokenCodec.vectors`). The torch path
(`TokenCodec.center_distances`, sparse/deltakv_codec.py) gathers every candidate center
of every sequence into float32 vectors `[G, m, C]` before one batched product: at
Llama-3-8B shapes (C = 2 x 8 x 128), 64 sequences of 32K tokens, ~1.7 GB written and
read again per layer and step, for a `[G, m]` result.

Here a program (sequence g, BLOCK_M of its centers) follows each center's slot to its
full row (`state[slot]`, clamped at 0 as `DeltaKVStorage.read_full` does), reads the
row's key (post-RoPE, the model dtype) and value in chunks of BLOCK_D channels, turns
the key back by the center's position in registers (rotate-half: channels d and
d + D/2 pair up, so a head is walked as two halves, with cos/sin from the table
`rope_table` builds, deltakv/rope.py), and accumulates (x_c - x_t)^2 in float32. The
centers' rows are read once, in their stored width; nothing per center is written but
its distance.

The result is the full squared distance |x_t - x_c|^2. The torch path expands it as
|x_t|^2 + |x_c|^2 - 2 x_t.x_c; summing the squared differences instead is the same
value up to float32 rounding (and free of the expansion's cancellation), so the two
paths agree to ~1e-6 of the distances' scale and pick the same centers except in
near-ties. Under tensor parallelism each rank holds some KV heads, hence some channels
of the vectors: a rank's distance over its channels is its partial sum, and the caller
adds the ranks' (`CompressorShard.sum_over_ranks`), as for the torch path.

The launcher never waits for the device (shapes only), so it can sit in a captured
graph; positions past the cos/sin table are clamped to its last row, so the caller
sizes the table beyond every center's position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsevllm.attention.triton._common import check_last_dim_contiguous, next_pow2
from sparsevllm.deltakv.rope import RopeTable

# Centers per program: a tile of BLOCK_M x BLOCK_D holds a key half, its partner, their
# cos/sin and the accumulator, ~5 x 16 floats per thread at 32 x 64 and 4 warps.
BLOCK_M = 32
MAX_BLOCK_D = 64  # 128 bytes of a 16-bit row per load


@triton.jit
def _key_sq(  # type: ignore[no-untyped-def]
    acc, xt_g, fk_rows, c_pos, jm, cos_ptr, sin_ptr, num_positions,
    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):  # fmt: skip
    """`acc` `[BLOCK_M, BLOCK_D]` plus the squared differences over every head's key
    channels: the centers' keys (rows at `fk_rows` `[BLOCK_M]`) turned back by their
    positions `c_pos` `[BLOCK_M]`, against the token's pre-RoPE key at `xt_g`."""
    offs_d = tl.arange(0, BLOCK_D)
    at_pos = tl.minimum(tl.maximum(c_pos, 0), num_positions - 1).to(tl.int64)
    for d0 in tl.static_range(0, HALF, BLOCK_D):
        dm = (d0 + offs_d) < HALF
        m2 = jm[:, None] & dm[None, :]
        if HAS_ROPE:
            # One angle per (center, pair), shared by the heads: loaded once per chunk.
            at = at_pos[:, None] * HALF + d0 + offs_d[None, :]
            cos = tl.load(cos_ptr + at, mask=m2, other=1.0)  # [BLOCK_M, BLOCK_D]
            sin = tl.load(sin_ptr + at, mask=m2, other=0.0)
        for h in range(HKV):
            at_k = fk_rows[:, None] + (h * D + d0) + offs_d[None, :]
            lo = tl.load(at_k, mask=m2, other=0.0).to(tl.float32)  # channels d
            hi = tl.load(at_k + HALF, mask=m2, other=0.0).to(tl.float32)  # channels d + D/2
            if HAS_ROPE:
                # deltakv/rope.py `unrotate`: the rotation by -angle.
                lo, hi = lo * cos + hi * sin, hi * cos - lo * sin
            t_at = xt_g + h * D + d0 + offs_d
            e_lo = lo - tl.load(t_at, mask=dm, other=0.0)[None, :]
            e_hi = hi - tl.load(t_at + HALF, mask=dm, other=0.0)[None, :]
            acc += e_lo * e_lo + e_hi * e_hi
    return acc


@triton.jit
def _value_sq(  # type: ignore[no-untyped-def]
    acc, xt_g, fv_rows, jm, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr
):
    """`acc` plus the squared differences over the value channels (the vectors' second
    half: a row's `[Hkv, D]` values read flat, in chunks of BLOCK_D)."""
    offs_d = tl.arange(0, BLOCK_D)
    for c0 in range(0, HKV * D, BLOCK_D):
        cm = (c0 + offs_d) < HKV * D
        m2 = jm[:, None] & cm[None, :]
        v = tl.load(fv_rows[:, None] + c0 + offs_d[None, :], mask=m2, other=0.0)
        e = v.to(tl.float32) - tl.load(xt_g + HKV * D + c0 + offs_d, mask=cm, other=0.0)[None, :]
        acc += e * e  # 0 off the channels: both read as 0
    return acc


@triton.jit
def _center_distance_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations as kernel types
    xt_ptr, fk_ptr, fv_ptr, state_ptr, table_ptr, c_pos_ptr, valid_ptr, cos_ptr, sin_ptr,
    out_ptr, m, num_positions, stride_xt, stride_tab, stride_valid, stride_out, stride_kr,
    stride_vr,
    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_ROPE: tl.constexpr,
):  # fmt: skip
    """Program (sequence g, tile of BLOCK_M centers): their squared distances to the
    sequence's token, +inf where `valid` is False."""
    g = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    jm = offs_m < m
    slot = tl.load(table_ptr + g * stride_tab + offs_m, mask=jm, other=0).to(tl.int64)
    # read_full's clamp: a slot that holds no row (only ever a masked entry) reads row 0.
    row = tl.maximum(tl.load(state_ptr + slot, mask=jm, other=0), 0).to(tl.int64)
    c_pos = tl.load(c_pos_ptr + offs_m, mask=jm, other=0)
    xt_g = xt_ptr + g * stride_xt
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc = _key_sq(
        acc, xt_g, fk_ptr + row * stride_kr, c_pos, jm, cos_ptr, sin_ptr, num_positions,
        HKV, D, HALF, BLOCK_D, HAS_ROPE,
    )  # fmt: skip
    acc = _value_sq(acc, xt_g, fv_ptr + row * stride_vr, jm, HKV, D, BLOCK_D)
    dist = tl.sum(acc, axis=1)  # [BLOCK_M]
    ok = tl.load(valid_ptr + g * stride_valid + offs_m, mask=jm, other=0) != 0
    tl.store(out_ptr + g * stride_out + offs_m, tl.where(ok, dist, float("inf")), mask=jm)


def center_distances(
    xt: torch.Tensor,  # [G, C] float32: each sequence's token vector (C = 2 * Hkv * D)
    full_k: torch.Tensor,  # [rows, Hkv, D] the storage's full rows, post-RoPE keys
    full_v: torch.Tensor,  # [rows, Hkv, D]
    state: torch.Tensor,  # [num_slots] int32: a full slot's row (kv/deltakv.py)
    table: torch.Tensor,  # [G, m] int: each sequence's candidate centers' slots
    c_pos: torch.Tensor,  # [m] int: the centers' positions (shared by the sequences)
    valid: torch.Tensor,  # [G, m] bool: a real center of that sequence
    rope: RopeTable | None,  # rope_table(freqs, P), P > every position; None: no RoPE
    *,
    out: torch.Tensor | None = None,  # [G, m] float32
    block_m: int = BLOCK_M,
    block_d: int | None = None,  # channels per load (default: min(D/2, 64), a power of 2)
    num_warps: int = 4,
) -> torch.Tensor:  # [G, m] float32
    """Squared L2 distances `[G, m]` between each sequence's token vector and its
    candidate centers' vectors, +inf where `valid` is False (module docstring)."""
    num_seqs, m = table.shape
    num_kv_heads, head_dim = full_k.shape[1:]
    _check_args(xt, full_k, full_v, table, c_pos, valid, rope)
    if out is None:
        out = torch.empty((num_seqs, m), dtype=torch.float32, device=xt.device)
    if num_seqs == 0 or m == 0:
        return out
    half = head_dim // 2
    bd = block_d if block_d is not None else min(MAX_BLOCK_D, next_pow2(half))
    cos, sin = rope if rope is not None else (xt, xt)  # never read without RoPE
    _center_distance_kernel[(num_seqs, triton.cdiv(m, block_m))](
        xt, full_k, full_v, state, table, c_pos, valid.view(torch.uint8), cos, sin, out, m,
        cos.shape[0], xt.stride(0), table.stride(0), valid.stride(0), out.stride(0),
        full_k.stride(0), full_v.stride(0),
        HKV=num_kv_heads, D=head_dim, HALF=half, BLOCK_M=block_m, BLOCK_D=bd,
        HAS_ROPE=rope is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


def _check_args(
    xt: torch.Tensor,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    table: torch.Tensor,
    c_pos: torch.Tensor,
    valid: torch.Tensor,
    rope: RopeTable | None,
) -> None:
    """The layouts the kernel addresses: rows of `[Hkv, D]` contiguous elements, unit
    last strides, float32 tokens and tables, matching shapes (host metadata only)."""
    num_seqs, m = table.shape
    num_kv_heads, head_dim = full_k.shape[1:]
    if head_dim % 2 or full_v.shape[1:] != full_k.shape[1:]:
        raise ValueError(f"bad full rows: K {tuple(full_k.shape)}, V {tuple(full_v.shape)}")
    for name, t in (("full_k", full_k), ("full_v", full_v)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} rows must be contiguous [Hkv, D], got {t.stride()}")
    want = (num_seqs, 2 * num_kv_heads * head_dim)
    if xt.dtype != torch.float32 or tuple(xt.shape) != want:
        raise ValueError(f"xt must be float32 {list(want)}, got {xt.dtype} {list(xt.shape)}")
    if tuple(valid.shape) != (num_seqs, m) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool [{num_seqs}, {m}], got {valid.dtype}")
    if tuple(c_pos.shape) != (m,):
        raise ValueError(f"c_pos must be [{m}], got {list(c_pos.shape)}")
    for name, t in (("xt", xt), ("table", table), ("c_pos", c_pos), ("valid", valid)):
        check_last_dim_contiguous(name, t)
    if rope is not None:
        cos, sin = rope
        for t in (cos, sin):
            if t.dtype != torch.float32 or tuple(t.shape[1:]) != (head_dim // 2,):
                raise ValueError(f"rope tables must be float32 [P, {head_dim // 2}]")
            if not t.is_contiguous() or t.shape[0] < 1 or t.shape != cos.shape:
                raise ValueError("rope tables must be contiguous, non-empty, alike")
