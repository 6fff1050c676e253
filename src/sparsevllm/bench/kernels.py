"""Correctness check + timing of the Triton attention kernels on a CUDA GPU.

    python -m sparsevllm.bench.kernels --json out.json

* Decode: batch 64 x 8K context, Llama-3-8B layer shapes (Hq 32, Hkv 8, D 128, bf16),
  views over randomly permuted slots, for 1 split, the automatic choice and a sweep;
  compared with the byte floor = K+V bytes read / device-to-device copy bandwidth
  (measured here with a large torch copy, counting bytes read + written).
  `--kv-cache-dtype fp8_e4m3|int8` times the decode benchmarks on a quantized cache;
  its floor counts the 1-byte elements plus the float32 per-token, per-head scales.
* Prefill: one 32K-token prompt (chunk = whole prompt) vs torch SDPA(is_causal=True)
  on contiguous q/k/v of the same shapes.

Times are triton.testing.do_bench medians in milliseconds.
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from sparsevllm.attention import torch_ref
from sparsevllm.attention.triton import auto_num_splits, decode_attention, prefill_attention
from sparsevllm.kv.format import KVFormat
from sparsevllm.kv.names import FORMAT_NAMES
from sparsevllm.kv.registry import check_device, get_format
from sparsevllm.kv.scaled import dequantize, quantize

DTYPE = torch.bfloat16
HQ, HKV, D = 32, 8, 128


def median_ms(fn: Any) -> float:
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


KVCache = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], int]


def make_kv(
    num_slots: int, device: torch.device, fmt: KVFormat, gen: torch.Generator | None = None
) -> KVCache:
    """Random K and V caches `[num_slots, Hkv, D]` in `fmt`, the scale keywords the
    kernels take with them (none for the model dtype) and the bytes of one full read
    (elements plus scales)."""
    k = torch.randn(num_slots, HKV, D, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn(num_slots, HKV, D, device=device, dtype=DTYPE, generator=gen)
    nbytes = num_slots * fmt.bytes_per_slot(HKV, D, DTYPE)
    if fmt.element_dtype is None:
        return k, v, {}, nbytes
    (k, k_scale), (v, v_scale) = quantize(k, fmt.element_dtype), quantize(v, fmt.element_dtype)
    return k, v, dict(k_scale=k_scale, v_scale=v_scale), nbytes


def kv_values(cache: torch.Tensor, scale: torch.Tensor | None, view: torch.Tensor) -> torch.Tensor:
    """float32 values of `cache` at slot ids `view` `[L]`: `[L, Hkv, D]`."""
    if scale is None:
        return cache[view].float()
    return dequantize(cache[view], scale[view], torch.float32)


def bench_decode(
    device: torch.device, bw: float, batch: int, ctx: int, fmt: KVFormat
) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    num_slots = batch * ctx
    # [num_slots, Hkv, D] each; views are a random permutation: no two neighbours adjacent.
    k_cache, v_cache, scales, kv_bytes = make_kv(num_slots, device, fmt, gen)
    perm = torch.randperm(num_slots, device=device, generator=gen).to(torch.int32)
    table = perm.view(batch, ctx).contiguous()  # [batch, ctx]
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE, generator=gen)  # [B, Hq, D]
    out = torch.empty_like(q)
    scale = D**-0.5

    def run(**kw: Any) -> None:
        decode_attention(q, k_cache, v_cache, table, rows, lens, scale, out, **scales, **kw)

    run(num_splits=None)
    errs = []
    for s in (0, batch // 2, batch - 1):
        view = table[s].long()
        k = kv_values(k_cache, scales.get("k_scale"), view)
        v = kv_values(v_cache, scales.get("v_scale"), view)
        ref = torch_ref.attend(q[s : s + 1].float(), k, v, scale)
        errs.append(rel_err(out[s], ref[0]))
    floor_ms = kv_bytes / bw * 1e3
    auto = auto_num_splits(batch, HKV, ctx, device)
    results = []
    configs = [dict(num_splits=1), dict(num_splits=None)]
    configs += [dict(num_splits=n) for n in (2, 4, 8, 16) if n != auto]
    configs += [dict(num_splits=None, block_n=bn) for bn in (32, 128)]
    configs += [dict(num_splits=None, num_warps=8), dict(num_splits=None, num_stages=3)]
    for cfg in configs:
        ms = median_ms(lambda cfg=cfg: run(**cfg))
        name = ", ".join(f"{k}={v}" for k, v in cfg.items())
        results.append(
            dict(
                config=name, ms=ms, tb_per_s=kv_bytes / (ms * 1e-3) / 1e12, floor_frac=floor_ms / ms
            )
        )
    # Extra modes: probabilities for H2O/TOVA/OmniKV, and a 2K-token per-head subset.
    scores = torch.empty(batch, HQ, ctx, dtype=torch.float32, device=device)
    ms_scores = median_ms(lambda: run(scores_out=scores))
    budget = 2048
    subset = torch.arange(budget, dtype=torch.int32, device=device) * (ctx // budget)
    subset = subset.expand(batch, HKV, budget).contiguous()  # [B, Hkv, budget]
    sub_lens = torch.full((batch,), budget, dtype=torch.int32, device=device)
    ms_subset = median_ms(lambda: run(subset=subset, subset_lens=sub_lens))
    return dict(
        batch=batch,
        ctx=ctx,
        kv_cache_dtype=fmt.name,
        kv_bytes=kv_bytes,
        floor_ms=floor_ms,
        auto_splits=auto,
        max_rel_err=max(errs),
        configs=results,
        scores_ms=ms_scores,
        subset_2k_ms=ms_subset,
    )


def graph_ms(fn: Any) -> float:
    """Median replay time of `fn` captured in a CUDA graph (no host launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def bench_decode_small(
    device: torch.device, bw: float, ctx: int, fmt: KVFormat
) -> list[dict[str, Any]]:
    """Small batches, where splits matter and host overhead would hide the kernels."""
    results = []
    for batch in (1, 8):
        num_slots = batch * ctx
        k_cache, v_cache, scales, kv_bytes = make_kv(num_slots, device, fmt)
        table = torch.randperm(num_slots, device=device).to(torch.int32).view(batch, ctx)
        rows = torch.arange(batch, dtype=torch.int32, device=device)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE)  # [B, Hq, D]
        out = torch.empty_like(q)
        row = dict(batch=batch, floor_ms=kv_bytes / bw * 1e3)
        row["auto_splits"] = auto_num_splits(batch, HKV, ctx, device)
        for name, splits in (("one_split_ms", 1), ("auto_ms", None)):
            args = (q, k_cache, v_cache, table, rows, lens, D**-0.5, out)
            fn = functools.partial(decode_attention, *args, num_splits=splits, **scales)
            row[name] = graph_ms(fn)
        results.append(row)
    return results


def bench_split_sweep(device: torch.device, bw: float, shape: str, fmt: KVFormat) -> dict[str, Any]:
    """Decode at `BATCHxCTX` (CUDA-graph timed) for a range of split counts: how far the
    automatic choice is from the best one at engine-like shapes."""
    batch, ctx = (int(x) for x in shape.lower().split("x"))
    num_slots = batch * ctx
    k_cache, v_cache, scales, kv_bytes = make_kv(num_slots, device, fmt)
    # Contiguous views, as the engine's free list mostly hands out.
    table = torch.arange(num_slots, device=device, dtype=torch.int32).view(batch, ctx)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE)  # [B, Hq, D]
    out = torch.empty_like(q)
    floor_ms = kv_bytes / bw * 1e3
    auto = auto_num_splits(batch, HKV, ctx, device)
    args = (q, k_cache, v_cache, table, rows, lens, D**-0.5, out)
    result: dict[str, Any] = dict(
        shape=shape, kv_cache_dtype=fmt.name, floor_ms=floor_ms, auto_splits=auto
    )
    # Grid orders: KV heads fastest (the default) and sequences fastest (the old one).
    for order, heads_fastest in (("heads_fastest", True), ("seqs_fastest", False)):
        times = {}
        for splits in sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, auto}):
            if splits * 256 <= ctx or splits == 1:
                fn = functools.partial(
                    decode_attention,
                    *args,
                    num_splits=splits,
                    heads_fastest=heads_fastest,
                    **scales,
                )
                times[splits] = graph_ms(fn)
        result[order] = dict(ms_by_splits=times, best_splits=min(times, key=times.get))
    del k_cache, v_cache, scales
    torch.cuda.empty_cache()
    return result


def bench_prefill(device: torch.device, seq: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(seq, HQ, D, device=device, dtype=DTYPE, generator=gen)  # [T, Hq, D]
    k = torch.randn(seq, HKV, D, device=device, dtype=DTYPE, generator=gen)  # [T, Hkv, D]
    v = torch.randn(seq, HKV, D, device=device, dtype=DTYPE, generator=gen)
    scale = D**-0.5
    # The prompt's tokens in randomly permuted slots of a pool of the same size.
    perm = torch.randperm(seq, device=device, generator=gen)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    k_cache[perm], v_cache[perm] = k, v
    table = perm.to(torch.int32).view(1, seq)
    ident = torch.arange(seq, dtype=torch.int32, device=device).view(1, seq)
    rows = torch.zeros(1, dtype=torch.int32, device=device)
    q_starts = torch.tensor([0, seq], dtype=torch.int32, device=device)
    lens = torch.tensor([seq], dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def run(tab: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, **kw: Any) -> None:
        prefill_attention(q, kc, vc, tab, rows, q_starts, lens, scale, out, seq, **kw)

    qs = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
    ks = k.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
    vs = v.transpose(0, 1).unsqueeze(0).contiguous()

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
        )

    ref = sdpa()[0].transpose(0, 1)  # [T, Hq, D]
    run(table, k_cache, v_cache)
    err = rel_err(out, ref)
    flops = 2 * 2 * HQ * D * seq * (seq + 1) / 2  # QK^T and PV over the causal half
    results = []
    configs: list[dict[str, int]] = [{}]
    configs += [
        dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
        dict(block_m=128, block_n=64, num_warps=4, num_stages=3),
        dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
        dict(block_m=128, block_n=32, num_warps=4, num_stages=4),
    ]
    for cfg in configs:
        ms = median_ms(lambda cfg=cfg: run(table, k_cache, v_cache, **cfg))
        name = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        results.append(dict(config=name, ms=ms, tflops=flops / (ms * 1e-3) / 1e12))
    ms_ident = median_ms(lambda: run(ident, k, v))
    ms_sdpa = median_ms(sdpa)
    return dict(
        seq=seq,
        max_rel_err_vs_sdpa=err,
        configs=results,
        contiguous_slots_ms=ms_ident,
        sdpa_ms=ms_sdpa,
        sdpa_tflops=flops / (ms_sdpa * 1e-3) / 1e12,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--prefill-len", type=int, default=32768)
    parser.add_argument(
        "--split-sweep",
        default="",
        help="comma-separated BATCHxCTX decode shapes to time for every split count "
        "(e.g. 24x32768,128x2112); alone, skips the other benchmarks",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=FORMAT_NAMES,
        help="KV cache format of the decode benchmarks (prefill always reads bf16)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA GPU")
    device = torch.device("cuda")
    fmt = get_format(args.kv_cache_dtype)
    check_device(fmt, device)
    bw = copy_bandwidth(device)
    if args.split_sweep:
        sweep = [bench_split_sweep(device, bw, sh, fmt) for sh in args.split_sweep.split(",")]
        for r in sweep:
            head = f"decode {r['shape']} ({fmt.name}): floor {r['floor_ms']:.3f} ms"
            print(f"{head}, auto {r['auto_splits']}")
            for order in ("heads_fastest", "seqs_fastest"):
                o = r[order]
                cells = "  ".join(f"{k}:{v:.3f}" for k, v in o["ms_by_splits"].items())
                print(f"  {order}: best {o['best_splits']} | splits:ms {cells}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(copy_bw_tb_per_s=bw / 1e12, split_sweep=sweep), f, indent=2)
        return
    dec = bench_decode(device, bw, args.batch, args.ctx, fmt)
    small = bench_decode_small(device, bw, args.ctx, fmt)
    torch.cuda.empty_cache()
    pre = bench_prefill(device, args.prefill_len)
    result = dict(
        device=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        copy_bw_tb_per_s=bw / 1e12,
        decode=dec,
        decode_small_batch_graph=small,
        prefill=pre,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\n{result['device']}  copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    print(
        f"decode B={dec['batch']} ctx={dec['ctx']} ({fmt.name}): floor {dec['floor_ms']:.3f} ms, "
        f"auto splits {dec['auto_splits']}, max rel err {dec['max_rel_err']:.2e}"
    )
    print(f"  {'config':<40} {'ms':>8} {'TB/s':>6} {'floor/t':>8}")
    for r in dec["configs"]:
        print(f"  {r['config']:<40} {r['ms']:8.3f} {r['tb_per_s']:6.2f} {r['floor_frac']:8.2f}")
    print(
        f"  with scores_out {dec['scores_ms']:.3f} ms; 2K-token subset {dec['subset_2k_ms']:.3f} ms"
    )
    for r in small:
        print(
            f"  B={r['batch']} (CUDA graph): floor {r['floor_ms']:.3f} ms, 1 split "
            f"{r['one_split_ms']:.3f} ms, auto ({r['auto_splits']}) {r['auto_ms']:.3f} ms"
        )
    print(f"prefill T={pre['seq']}: rel err vs SDPA {pre['max_rel_err_vs_sdpa']:.2e}")
    print(f"  {'config':<40} {'ms':>8} {'TFLOP/s':>8}")
    for r in pre["configs"]:
        print(f"  {r['config']:<40} {r['ms']:8.3f} {r['tflops']:8.1f}")
    print(f"  default on contiguous slots {pre['contiguous_slots_ms']:.3f} ms")
    print(f"  {'torch SDPA is_causal':<40} {pre['sdpa_ms']:8.3f} {pre['sdpa_tflops']:8.1f}")


if __name__ == "__main__":
    main()
