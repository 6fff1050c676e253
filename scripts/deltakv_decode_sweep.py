"""DeltaKV decode kernel v2: correctness and a tile/launch sweep against the torch path.

Builds a DeltaKVStorage at Llama-3-8B shapes (Hq 32, Hkv 8, D 128, bf16, latent r 512
INT4, 4 references, center stride 10) holding 32K-token views: the first 4 tokens, every
10th and the last 256 are full; the others are compressed (random latents through the
codec's real encoding) against their 4 nearest preceding full tokens. Then

  (a) the kernel against float32 attention over `storage.read` (max abs error),
  (b) CUDA-event timings (median of --iters after --warmup) of the torch materialising
      path (what the reference backend does per layer: storage.read + SDPA) and of the
      kernel over a pruned grid: block_n x block_r x num_warps at 2 stages and the
      default splits, then stages and split counts for the best few, then batch 8.

`--kernel rebuild` sweeps the two-phase path instead (attention/triton/deltakv_rebuild.py:
the rebuild kernel's tiles, warps and stages; the dense decode kernel picks its own
splits).

Prints a table (ms per layer) and writes $OUT/dk_sweep.json (OUT default /tmp/out;
`dk_sweep_rebuild.json` for `--kernel rebuild`).
`--tiny`: small shapes on the CPU under TRITON_INTERPRET=1 (wall-clock timings), to
prove the script end to end.

    PYTHONPATH=src python scripts/deltakv_decode_sweep.py            # on a CUDA machine (~3 min)
    TRITON_INTERPRET=1 PYTHONPATH=src python scripts/deltakv_decode_sweep.py --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sparsevllm.attention.triton import decode_deltakv as dk
from sparsevllm.attention.triton import deltakv_rebuild as rb
from sparsevllm.attention.triton.deltakv_tiles import DeltaKVTensors
from sparsevllm.deltakv.compressor import DeltaKVCompressor
from sparsevllm.deltakv.rope import rope_table
from sparsevllm.deltakv.shard import CompressorShard
from sparsevllm.deltakv.spec import DeltaKVSpec
from sparsevllm.kv.deltakv import DeltaKVStorage, deltakv_format
from sparsevllm.sparse.deltakv_codec import TokenCodec


@dataclass(frozen=True)
class Shapes:
    hq: int
    hkv: int
    d: int
    r: int
    length: int  # tokens per view
    recent: int  # the last tokens kept full
    batch: int  # views in the storage (the batch-B runs read all of them)
    rope_theta: float = 500000.0
    nref: int = 4
    stride: int = 10
    sink: int = 4


FULL = Shapes(hq=32, hkv=8, d=128, r=512, length=32768, recent=256, batch=8)
TINY = Shapes(hq=4, hkv=2, d=32, r=32, length=300, recent=32, batch=2)


@dataclass(frozen=True)
class Variant:
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int
    num_splits: int | None  # None: the launcher's default

    def label(self) -> str:
        splits = "auto" if self.num_splits is None else str(self.num_splits)
        return f"bn{self.block_n} br{self.block_r} w{self.num_warps} s{self.num_stages} sp{splits}"


@dataclass
class Bench:
    """The storage, its views and the kernel's other inputs."""

    storage: DeltaKVStorage
    codec: TokenCodec
    table: torch.Tensor  # [batch + 1, length] int32 slot ids (row 0 unused)
    shapes: Shapes
    rope: tuple[torch.Tensor, torch.Tensor]


# -- building the storage ---------------------------------------------------------------
def build(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> Bench:
    """A storage holding `shapes.batch` views of `shapes.length` tokens (module docstring)."""
    torch.manual_seed(0)
    spec = DeltaKVSpec(
        layers=(0,), num_kv_heads=shapes.hkv, head_dim=shapes.d, latent_dims=(shapes.r,)
    )
    compressor = DeltaKVCompressor(spec).to(device)
    d = shapes.d
    freqs = 1.0 / shapes.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
    codec = TokenCodec(CompressorShard(compressor, (0, shapes.hkv)), 0, freqs, bits=4, fused=True)
    num_slots = shapes.batch * shapes.length + 16
    fmt = deltakv_format(codec.code_bytes(), shapes.nref, shapes.stride, 0)
    # Room for every token's row at once: each view is stored full, then compressed.
    fmt = dataclasses.replace(fmt, fixed_rows=num_slots)
    storage = DeltaKVStorage(fmt, num_slots, shapes.hkv, d, dtype, device)
    storage.attach_decoder(codec)
    perm = torch.randperm(num_slots - 16, device=device)  # shuffled slots, as in a pool
    table = torch.zeros((shapes.batch + 1, shapes.length), dtype=torch.int32, device=device)
    for i in range(shapes.batch):
        slots = perm[i * shapes.length : (i + 1) * shapes.length]
        table[i + 1] = slots.int()
        fill_view(storage, codec, slots, shapes)
    return Bench(storage, codec, table, shapes, rope_table(freqs, shapes.length))


def fill_view(
    storage: DeltaKVStorage, codec: TokenCodec, slots: torch.Tensor, shapes: Shapes
) -> None:
    """Store random K/V at `slots` `[L]` (position = index), then compress every token
    but the sink, the centers and the recent tail against its 4 nearest preceding full
    tokens, with random latents encoded by the codec."""
    n, device = slots.numel(), slots.device
    k = torch.randn(n, shapes.hkv, shapes.d, device=device)
    v = torch.randn(n, shapes.hkv, shapes.d, device=device)
    storage.store(k, v, slots)
    pos = torch.arange(n, device=device)
    centers = pos[(pos < shapes.sink) | (pos % shapes.stride == 0)]  # [M] ascending
    full = (pos < shapes.sink) | (pos % shapes.stride == 0) | (pos >= n - shapes.recent)
    comp = pos[~full]  # [n_c]
    before = torch.searchsorted(centers, comp)  # [n_c] centers before each (>= sink)
    pick = before[:, None] - torch.arange(1, shapes.nref + 1, device=device)[None, :]
    ref_pos = centers[pick]  # [n_c, R] nearest first
    latent = 3 * torch.randn(comp.numel(), codec.width, device=device)
    storage.compress(slots[comp], comp, codec.encode(latent), slots[ref_pos], ref_pos)


# -- the two paths ----------------------------------------------------------------------
def tensors(bench: Bench) -> DeltaKVTensors:
    """What the kernels read of the bench's layer."""
    s, up = bench.storage, bench.codec.up_map(bench.storage.dtype)
    assert up is not None
    return DeltaKVTensors(
        s.state, s.latent, s.refs, s.pos, s.full_k, s.full_v, s.row_pos, up.weight, up.bias,
        up.freqs, up.bits,
    )  # fmt: skip


def kernel_call(bench: Bench, q: torch.Tensor, variant: Variant) -> Callable[[], torch.Tensor]:
    t = tensors(bench)
    rows = torch.arange(1, q.shape[0] + 1, dtype=torch.int32, device=q.device)
    lens = torch.full((q.shape[0],), bench.shapes.length, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(bench.shapes.d)
    if KERNEL["name"] == "rebuild":

        def rebuild() -> torch.Tensor:
            return rb.deltakv_rebuild_attention(
                q, t, bench.table, rows, lens, bench.shapes.length, scale, out,
                rope=bench.rope, block_n=variant.block_n,
                block_r=variant.block_r, num_warps=variant.num_warps,
                num_stages=variant.num_stages,
            )  # fmt: skip

        return rebuild

    def run() -> torch.Tensor:
        return dk.deltakv_decode_attention(
            q, t, bench.table, rows, lens, scale, out, rope=bench.rope,
            num_splits=variant.num_splits, block_n=variant.block_n,
            block_r=variant.block_r, num_warps=variant.num_warps,
            num_stages=variant.num_stages,
        )  # fmt: skip

    return run


def attend_padded(
    q: torch.Tensor,  # [S, Hq, D]
    storage: DeltaKVStorage,
    slots: torch.Tensor,  # [S, L]
    scale: float,
) -> torch.Tensor:  # [S, Hq, D]
    """What the reference backend does per group of views: the storage's materialised
    read of every entry, then SDPA with the query heads of a KV head folded."""
    s, hq = q.shape[:2]
    k, v = storage.read(slots.reshape(-1))  # [S * L, Hkv, D]
    hkv = k.shape[1]
    kt = k.to(q.dtype).view(s, slots.shape[1], hkv, -1).transpose(1, 2)  # [S, Hkv, L, D]
    vt = v.to(q.dtype).view(s, slots.shape[1], hkv, -1).transpose(1, 2)
    qf = q.view(s, hkv, hq // hkv, q.shape[-1])  # [S, Hkv, G, D]
    return F.scaled_dot_product_attention(qf, kt, vt, scale=scale).reshape(s, hq, -1)


def torch_call(bench: Bench, q: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The reference backend's batched decode: storage.read of the padded views (in
    groups of at most 128K entries, torch_ref.MAX_READ_TOKENS) and SDPA."""
    slots = bench.table[1 : q.shape[0] + 1].long()  # [S, L]
    scale = 1 / math.sqrt(bench.shapes.d)
    per_group = max(1, (1 << 17) // slots.shape[1])

    def run() -> torch.Tensor:
        outs = [
            attend_padded(q[i : i + per_group], bench.storage, slots[i : i + per_group], scale)
            for i in range(0, q.shape[0], per_group)
        ]
        return torch.cat(outs)

    return run


def reference(bench: Bench, q: torch.Tensor) -> torch.Tensor:
    """float32 attention over `storage.read` of each view: `[S, Hq, D]`."""
    outs = []
    group = bench.shapes.hq // bench.shapes.hkv
    for i in range(q.shape[0]):
        k, v = bench.storage.read(bench.table[i + 1].long())  # [L, Hkv, D]
        k = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        w = torch.einsum("hd,lhd->hl", q[i].float(), k) / math.sqrt(bench.shapes.d)
        outs.append(torch.einsum("hl,lhd->hd", w.softmax(-1), v))
    return torch.stack(outs)


# -- timing -----------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    samples = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(samples)


def measure(
    bench: Bench, q: torch.Tensor, want: torch.Tensor, variant: Variant, args: argparse.Namespace
) -> dict[str, Any]:
    """One variant: its error against `want`, its time, or the exception it raised."""
    row: dict[str, Any] = {**dataclasses.asdict(variant), "batch": q.shape[0]}
    if time.perf_counter() > args.deadline:
        row.update(error="skipped: past --budget seconds")
        print(f"  B={q.shape[0]} {variant.label():32s} {fmt_row(row)}", flush=True)
        return row
    try:
        run = kernel_call(bench, q, variant)
        before = compiled_kernels()
        err = (run().float() - want).abs().max().item()
        row.update(ms=time_ms(run, args.warmup, args.iters), max_abs_err=err)
        row.update(compiled_info(variant, before))
    except Exception as e:  # a config that does not compile (registers, shared memory)
        first_line = (str(e).splitlines() or [""])[0][:200]
        row.update(error=f"{type(e).__name__}: {first_line}")
        if args.verbose:
            traceback.print_exc()
    print(f"  B={q.shape[0]} {variant.label():32s} {fmt_row(row)}", flush=True)
    return row


# The kernel the sweep times (--kernel): "fused" or "rebuild".
KERNEL = {"name": "fused"}


def compiled_kernels() -> dict[int, Any]:
    """The swept kernel's compiled binaries so far, by id (GPU only)."""
    found: dict[int, Any] = {}
    jit = rb._rebuild_kernel if KERNEL["name"] == "rebuild" else dk._deltakv_decode_kernel
    for dev_caches in getattr(jit, "device_caches", {}).values():
        for kernel in dev_caches[0].values():
            found[id(kernel)] = kernel
    return found


# (block_n, block_r, num_warps, num_stages) -> registers and spills of its binary.
_COMPILED: dict[tuple[int, int, int, int], dict[str, Any]] = {}


def compiled_info(variant: Variant, before: dict[int, Any]) -> dict[str, Any]:
    """Registers and spills of the binary `variant` compiled (the one that appeared in
    its first call; split counts share a binary)."""
    key = (variant.block_n, variant.block_r, variant.num_warps, variant.num_stages)
    new = [k for i, k in compiled_kernels().items() if i not in before]
    if new:
        kernel = new[-1]
        _COMPILED[key] = {
            "regs": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None),
        }
    return _COMPILED.get(key, {})


def fmt_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"FAILED {row['error']}"
    extra = f" regs {row['regs']} spills {row['spills']}" if row.get("regs") else ""
    return f"{row['ms']:8.3f} ms  err {row['max_abs_err']:.2e}{extra}"


# -- the sweep --------------------------------------------------------------------------
def sweep(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """Batch 1 over tile shapes and warps, batch B over split counts for the best of
    them, then batch 1 over stages and split counts for the best (the order a --budget
    cut hurts least)."""
    shapes = bench.shapes
    device = bench.table.device
    result: dict[str, Any] = {"shapes": dataclasses.asdict(shapes), "runs": []}
    g = torch.Generator(device="cpu").manual_seed(1)
    q_all = torch.randn(shapes.batch, shapes.hq, shapes.d, generator=g).to(device, args.dtype)
    grid = args.grid
    q1, want1 = baseline(bench, q_all[:1].contiguous(), result, args)
    fused_defaults(bench, q1, result, args)
    first = stage_one(grid)
    runs = [measure(bench, q1, want1, v, args) for v in first]
    best = best_tiles(runs, args.keep)
    qb, wantb = baseline(bench, q_all, result, args)
    fused_defaults(bench, qb, result, args)
    runs += [measure(bench, qb, wantb, v, args) for v in stage_batch(grid, best)]
    runs += [measure(bench, q1, want1, v, args) for v in stage_two(grid, best, first)]
    result["runs"] = runs
    return result


def baseline(
    bench: Bench, q: torch.Tensor, result: dict[str, Any], args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 reference of batch `q` and the torch path's error and time (kept in
    `result`): returns q and the reference."""
    want = reference(bench, q)
    run = torch_call(bench, q)
    batch = q.shape[0]
    err = (run().float() - want).abs().max().item()
    result[f"torch_ms_b{batch}"] = ms = time_ms(run, args.warmup, args.iters)
    result[f"torch_err_b{batch}"] = err
    print(f"B={batch} torch path (read + SDPA): {ms:.3f} ms  err {err:.2e}", flush=True)
    return q, want


def fused_defaults(
    bench: Bench, q: torch.Tensor, result: dict[str, Any], args: argparse.Namespace
) -> None:
    """Beside a rebuild sweep: the fused kernel at its launcher's defaults, timed on the
    same machine (kept in `result`)."""
    if args.kernel == "fused":
        return
    batch = q.shape[0]
    rows = torch.arange(1, batch + 1, dtype=torch.int32, device=q.device)
    lens = torch.full((batch,), bench.shapes.length, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)

    def run() -> torch.Tensor:
        return dk.deltakv_decode_attention(
            q, tensors(bench), bench.table, rows, lens, 1 / math.sqrt(bench.shapes.d), out,
            rope=bench.rope,
        )  # fmt: skip

    result[f"fused_default_ms_b{batch}"] = ms = time_ms(run, args.warmup, args.iters)
    print(f"B={batch} fused kernel at its defaults: {ms:.3f} ms", flush=True)


def stage_one(grid: dict[str, list[Any]]) -> list[Variant]:
    """Tile shapes and warps at 2 stages and the default split count."""
    return [
        Variant(bn, br, w, 2, None)
        for bn in grid["block_n"]
        for br in grid["block_r"]
        for w in grid["num_warps"]
    ]


def best_tiles(rows: list[dict[str, Any]], keep: int) -> list[tuple[int, int, int]]:
    """The `keep` fastest (block_n, block_r, num_warps) among the batch-1 runs."""
    ok = sorted((r for r in rows if "ms" in r and r["batch"] == 1), key=lambda r: r["ms"])
    seen: list[tuple[int, int, int]] = []
    for r in ok:
        key = (r["block_n"], r["block_r"], r["num_warps"])
        if key not in seen:
            seen.append(key)
    return seen[:keep]


def stage_two(
    grid: dict[str, list[Any]], best: list[tuple[int, int, int]], done: list[Variant]
) -> list[Variant]:
    """Stages and split counts for the best tile shapes."""
    out = []
    for bn, br, w in best:
        for st in grid["num_stages"]:
            for sp in grid["num_splits"]:
                v = Variant(bn, br, w, st, sp)
                if v not in done:
                    out.append(v)
    return out


def stage_batch(grid: dict[str, list[Any]], best: list[tuple[int, int, int]]) -> list[Variant]:
    """Batch B: the best tile shapes at 2 stages over the batch split counts."""
    return [Variant(bn, br, w, 2, sp) for bn, br, w in best for sp in grid["batch_splits"]]


def print_table(result: dict[str, Any]) -> None:
    print("\nms per layer (median); torch path = storage.read + SDPA")
    for batch in sorted({r["batch"] for r in result["runs"]}):
        torch_ms = result[f"torch_ms_b{batch}"]
        print(f"-- batch {batch}: torch {torch_ms:.3f} ms")
        rows = sorted(result["runs"], key=lambda r: r.get("ms", math.inf))
        for r in rows:
            if r["batch"] != batch:
                continue
            v = Variant(
                r["block_n"], r["block_r"], r["num_warps"], r["num_stages"], r["num_splits"]
            )
            speed = f"  x{torch_ms / r['ms']:.1f} vs torch" if "ms" in r else ""
            print(f"  {v.label():32s} {fmt_row(r)}{speed}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU interpreter)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--keep", type=int, default=2, help="tile shapes carried to stage two")
    p.add_argument("--verbose", action="store_true", help="print failing configs' tracebacks")
    p.add_argument(
        "--kernel",
        choices=("fused", "rebuild"),
        default="fused",
        help="the fused decode kernel, or the two-phase rebuild + dense decode",
    )
    p.add_argument(
        "--budget", type=float, default=200.0, help="seconds after which configs are skipped"
    )
    args = p.parse_args()
    args.deadline = time.perf_counter() + args.budget
    args.dtype = torch.bfloat16
    KERNEL["name"] = args.kernel
    if args.tiny:
        args.warmup, args.iters, args.keep = 1, 2, 1
        args.grid = dict(
            block_n=[32, 64], block_r=[16], num_warps=[4], num_stages=[1, 2],
            num_splits=[None, 2], batch_splits=[None, 2],
        )  # fmt: skip
    else:
        args.grid = dict(
            # The likeliest first: a --budget cut skips the least promising.
            block_n=[64, 128, 32], block_r=[32, 64], num_warps=[8, 4], num_stages=[1, 2, 3],
            num_splits=[None, 16, 32, 64], batch_splits=[None, 4, 8, 16],
        )  # fmt: skip
    if args.kernel == "rebuild":  # the dense decode kernel picks its splits
        args.grid.update(num_splits=[None], batch_splits=[None])
        if not args.tiny:
            args.grid.update(block_n=[64, 128, 32], block_r=[64, 32], num_warps=[4, 8])
    return args


def patch_interpreter() -> None:
    """Under TRITON_INTERPRET=1, the kernel tests' fixes for the Triton 3.6 interpreter
    (tests/kernels/conftest.py applies them on import)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "tests", "kernels", "conftest.py")
    spec = importlib.util.spec_from_file_location("kernel_conftest", path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def main() -> None:
    args = parse()
    patch_interpreter()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    bench = build(TINY if args.tiny else FULL, device, args.dtype)
    print(f"built {bench.shapes} on {device} in {time.perf_counter() - t0:.1f} s", flush=True)
    if cuda:
        print(torch.cuda.get_device_name(), flush=True)
    result = sweep(bench, args)
    result["device"] = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    result["seconds"] = time.perf_counter() - t0
    print_table(result)
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    name = "dk_sweep.json" if args.kernel == "fused" else f"dk_sweep_{args.kernel}.json"
    result["kernel"] = args.kernel
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}/{name} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
