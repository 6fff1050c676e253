"""Correctness check + timing of the KIVI decode kernel (int4 / int2) on a CUDA GPU,
side by side with the bf16 decode kernel over the same views.

    python -m sparsevllm.bench.kivi_kernels --json out.json

Batch 64 x 8K context (Llama-3-8B layer shapes: Hq 32, Hkv 8, D 128, bf16 queries),
views over randomly permuted slots (`--slots permuted`, the worst case: every token's
rows elsewhere) or over consecutive slots (`--slots sequential`, what the engine's
default slot order gives most prompts). Each view's newest `--residual` tokens stay in
full precision, the rest is sealed in order (G = `--group` tokens to a key group), as
the engine leaves a view after prefill. The byte floor counts what the kernel must read:
codes, value parameters, each slot's state and table entry, each key group's parameters
once, and the residual rows; over the bandwidth of a large device-to-device copy.
Times are triton.testing.do_bench medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
import triton
import triton.language as tl

from sparsevllm.attention import torch_ref
from sparsevllm.attention.triton import decode_attention
from sparsevllm.attention.triton.decode_kivi import kivi_decode_attention
from sparsevllm.bench.kernels import DTYPE, HKV, HQ, D, copy_bandwidth, median_ms, rel_err
from sparsevllm.kv.format import FormatSizing
from sparsevllm.kv.kivi import KiviStorage
from sparsevllm.kv.registry import get_format

STORE_CHUNK = 8192  # tokens stored, then sealed, at a time


def build(
    name: str, batch: int, ctx: int, group: int, residual: int, permuted: bool
) -> dict[str, Any]:
    """KIVI storage of `batch` views of `ctx` tokens (random K/V) and their tables."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    sizing = FormatSizing(group, residual, batch, STORE_CHUNK, scratch_rows=0)
    fmt = get_format(name).sized(sizing)
    num_slots = batch * ctx
    storage = fmt.create(num_slots, HKV, D, DTYPE, device)
    assert isinstance(storage, KiviStorage)
    table = _slot_order(num_slots, permuted, gen).view(batch, ctx).contiguous()  # [batch, ctx]
    for s in range(batch):
        for a in range(0, ctx, STORE_CHUNK):
            slots = table[s, a : a + STORE_CHUNK].long()
            k = torch.randn(slots.numel(), HKV, D, device=device, dtype=DTYPE, generator=gen)
            v = torch.randn(slots.numel(), HKV, D, device=device, dtype=DTYPE, generator=gen)
            storage.store(k, v, slots)
            sealed = min(slots.numel(), max(0, ctx - residual - a)) // group * group
            if sealed:
                storage.seal(slots[:sealed].view(-1, group))
    return dict(storage=storage, table=table, sealed=(ctx - residual) // group * group)


def _slot_order(num_slots: int, permuted: bool, gen: torch.Generator) -> torch.Tensor:
    if permuted:
        return torch.randperm(num_slots, device=gen.device, generator=gen).to(torch.int32)
    return torch.arange(num_slots, device=gen.device, dtype=torch.int32)


def floor_bytes(storage: KiviStorage, batch: int, ctx: int, sealed: int) -> int:
    """What one decode step over every view must read (module docstring)."""
    per_sealed = HKV * (2 * D * storage.bits // 8 + 4)  # codes + value (scale, zero)
    groups = batch * math.ceil(sealed / storage.kivi.group_size)
    residual = batch * (ctx - sealed)
    return (
        batch * sealed * per_sealed
        + groups * HKV * D * 4
        + residual * HKV * D * 2 * DTYPE.itemsize
        + batch * ctx * (4 + 4)  # state + table entry
    )


@triton.jit
def _read_probe_kernel(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, par_ptr, table_ptr, out_ptr, ctx, stride_cs, stride_ch, stride_ps,
    P: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """What the decode kernel's fast loop reads, and nothing else: per (KV head, view,
    split) the table entries, packed K and V rows and value parameters, summed."""
    kvh, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, P)
    acc = tl.zeros([BLOCK_N, P], tl.int32)
    for j in range(start, end, BLOCK_N):
        ok = (j + offs_n) < end
        slot = tl.load(table_ptr + s.to(tl.int64) * ctx + j + offs_n, mask=ok, other=0)
        row = slot.to(tl.int64)[:, None] * stride_cs + kvh * stride_ch + offs_p[None, :]
        acc += tl.load(k_ptr + row, mask=ok[:, None], other=0).to(tl.int32)
        acc += tl.load(v_ptr + row, mask=ok[:, None], other=0).to(tl.int32)
        par = tl.load(par_ptr + slot.to(tl.int64) * stride_ps + kvh, mask=ok, other=0)
        acc += par[:, None] & 0xFF  # small: the sum must not overflow
    tl.store(out_ptr + (s * tl.num_programs(0) + kvh) * NUM_SPLITS + split, tl.sum(acc))


def read_probe_ms(storage: KiviStorage, table: torch.Tensor, block_n: int) -> dict[str, float]:
    """The fastest of a few split counts for the read-only probe (its own floor: the
    codes, value parameters and table entries it reads)."""
    buffers = storage.buffers()
    k, v = buffers["k"], buffers["v"]
    par = buffers["v_params"].view(torch.int32).squeeze(-1)
    batch, ctx = table.shape
    best = float("inf")
    for splits in (4, 8, 16):
        out = torch.empty(batch * HKV * splits, dtype=torch.int32, device=table.device)
        grid = (HKV, batch, splits)
        ms = median_ms(
            lambda grid=grid, out=out, splits=splits: _read_probe_kernel[grid](
                k,
                v,
                par,
                table,
                out,
                ctx,
                k.stride(0),
                k.stride(1),
                par.stride(0),
                P=k.shape[2],
                BLOCK_N=block_n,
                NUM_SPLITS=splits,
                num_warps=2,
            )  # fmt: skip
        )
        best = min(best, ms)
    nbytes = table.numel() * (HKV * (2 * k.shape[2] + 4) + 4)
    return dict(ms=best, bytes=nbytes)


def bench(
    name: str, batch: int, ctx: int, group: int, residual: int, bw: float, permuted: bool
) -> dict[str, Any]:
    built = build(name, batch, ctx, group, residual, permuted)
    storage, table = built["storage"], built["table"]
    device = table.device
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    scale = D**-0.5
    buffers = storage.buffers()

    def run(**kw: Any) -> None:
        kivi_decode_attention(
            q, buffers["k"], buffers["v"], buffers["v_params"], buffers["state"],
            storage.key_groups, storage.res_k, storage.res_v, table, rows, lens, scale, out,
            bits=storage.bits, block_n=group, **kw,
        )  # fmt: skip

    run()
    errs = []
    for s in (0, batch - 1):
        k, v = storage.read(table[s].long())
        ref = torch_ref.attend(q[s : s + 1].float(), k.float(), v.float(), scale)
        errs.append(rel_err(out[s], ref[0]))
    nbytes = floor_bytes(storage, batch, ctx, built["sealed"])
    floor_ms = nbytes / bw * 1e3
    # Tiles of one key group each (block_n = G) take the kernel's fast loop.
    configs: list[dict[str, Any]] = [dict(num_splits=None, num_warps=w) for w in (2, 4, 8)]
    configs += [dict(num_splits=None, num_stages=n) for n in (1, 2, 4)]
    configs += [dict(num_splits=n) for n in (2, 4, 8, 16)]
    configs += [dict(num_splits=None, asm_unpack=False)]
    configs += [dict(num_splits=None, dequant_keys=False, num_stages=n) for n in (2, 3, 4)]
    configs += [dict(num_splits=None, dequant_keys=False, num_warps=4)]
    # The query heads padded to 16 rows (the kernel before session 28), both key modes.
    configs += [
        dict(num_splits=None, block_g=16),
        dict(num_splits=None, block_g=16, dequant_keys=False),
    ]
    results = []
    for cfg in configs:
        ms = median_ms(lambda cfg=cfg: run(**cfg))
        name_ = ", ".join(f"{k}={v}" for k, v in cfg.items())
        results.append(dict(config=name_, ms=ms, floor_frac=floor_ms / ms))
    best = min(results, key=lambda r: r["ms"])
    probe = read_probe_ms(storage, table, group)
    probe["floor_frac"] = probe["bytes"] / bw * 1e3 / probe["ms"]
    return dict(
        read_probe=probe,
        kv_cache_dtype=name, group=group, residual=residual, floor_bytes=nbytes,
        floor_ms=floor_ms, max_rel_err=max(errs), configs=results, best=best,
    )  # fmt: skip


def bench_bf16(batch: int, ctx: int, bw: float, permuted: bool) -> dict[str, Any]:
    """The bf16 decode kernel over the same shapes (its floor: K + V bytes)."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    num_slots = batch * ctx
    k = torch.randn(num_slots, HKV, D, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    table = _slot_order(num_slots, permuted, gen).view(batch, ctx).contiguous()
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    ms = median_ms(lambda: decode_attention(q, k, v, table, rows, lens, D**-0.5, out))
    nbytes = 2 * num_slots * HKV * D * DTYPE.itemsize + num_slots * 4
    return dict(ms=ms, floor_bytes=nbytes, floor_frac=nbytes / bw * 1e3 / ms)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch", type=int, default=64, help="sequences (default 64)")
    parser.add_argument("--ctx", type=int, default=8192, help="tokens per view (default 8192)")
    parser.add_argument("--group", type=int, default=32, help="KIVI's G (default 32)")
    parser.add_argument("--residual", type=int, default=128, help="KIVI's R (default 128)")
    parser.add_argument("--formats", default="int4,int2", help="comma-separated (int4,int2)")
    parser.add_argument(
        "--slots",
        choices=("permuted", "sequential"),
        default="permuted",
        help="slot order of the views (default permuted: the worst case)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kivi_kernels needs a CUDA GPU")
    bw = copy_bandwidth(torch.device("cuda"))
    permuted = args.slots == "permuted"
    dense = bench_bf16(args.batch, args.ctx, bw, permuted)
    torch.cuda.empty_cache()
    formats = []
    for name in args.formats.split(","):
        formats.append(bench(name, args.batch, args.ctx, args.group, args.residual, bw, permuted))
        torch.cuda.empty_cache()
    result = dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, batch=args.batch,
        ctx=args.ctx, slots=args.slots, copy_bw_tb_per_s=bw / 1e12, bf16=dense, kivi=formats,
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"{result['device']}: copy bandwidth {bw / 1e12:.2f} TB/s; B={args.batch} x {args.ctx}")
    print(f"  bf16 decode {dense['ms']:.3f} ms ({dense['floor_frac']:.2f} of its floor)")
    for r in formats:
        b = r["best"]
        print(
            f"  {r['kv_cache_dtype']}: floor {r['floor_ms']:.3f} ms, best {b['ms']:.3f} ms "
            f"({b['config']}; {b['floor_frac']:.2f} of the floor, {dense['ms'] / b['ms']:.2f}x "
            f"bf16), rel err {r['max_rel_err']:.1e}"
        )
        probe = r["read_probe"]
        print(f"    read-only probe {probe['ms']:.3f} ms ({probe['floor_frac']:.2f} of its floor)")


if __name__ == "__main__":
    main()
