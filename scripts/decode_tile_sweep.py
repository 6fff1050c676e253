"""Decode-kernel tile sweep on the GPU (dummy Llama-3-8B attention shapes: 32 query
heads, 8 KV heads, head_dim 128, bf16 queries): every (block_n, num_stages, num_warps)
for each KV storage format and (batch, context) shape, automatic splits, random slot
permutations; each time against the byte floor (KV bytes read / measured copy bandwidth).

    PYTHONPATH=src python scripts/decode_tile_sweep.py --json OUT.json

Picks decode defaults from data; it changes nothing itself.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from sparsevllm.attention.triton import decode_attention
from sparsevllm.bench.kernels import DTYPE, HQ, D, copy_bandwidth, make_kv, median_ms
from sparsevllm.kv.registry import get_format

SHAPES = [(1, 32768), (8, 32768), (24, 32768), (64, 8192), (128, 2048)]
NOTE = (
    "ms per decode_attention call (triton.testing.do_bench median, not CUDA-graph timed); "
    "floor_ms = KV bytes / copy bandwidth (read + write), which a read-only stream can beat, "
    "so it is a reference, not a bound"
)
TILES = list(itertools.product((64, 128, 256), (2, 3, 4), (4, 8)))


def sweep_shape(fmt_name: str, batch: int, ctx: int, bw: float) -> list[dict[str, object]]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    k_cache, v_cache, scales, kv_bytes = make_kv(batch * ctx, device, get_format(fmt_name), gen)
    perm = torch.randperm(batch * ctx, device=device, generator=gen).to(torch.int32)
    table = perm.view(batch, ctx).contiguous()
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE, generator=gen)
    out = torch.empty_like(q)
    floor_ms = kv_bytes / bw * 1e3
    rows_out = []
    for block_n, stages, warps in TILES:
        kw = dict(block_n=block_n, num_stages=stages, num_warps=warps, **scales)
        try:
            ms = median_ms(
                lambda kw=kw: decode_attention(
                    q, k_cache, v_cache, table, rows, lens, D**-0.5, out, **kw
                )
            )
        except Exception as e:  # a tile that does not fit in shared memory
            rows_out.append(
                dict(block_n=block_n, num_stages=stages, num_warps=warps, error=str(e)[:120])
            )
            continue
        rows_out.append(
            dict(block_n=block_n, num_stages=stages, num_warps=warps, ms=ms, floor_ms=floor_ms)
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="Where to write the results.")
    parser.add_argument("--formats", default="auto,int8,fp8_e4m3", help="KV formats to sweep.")
    args = parser.parse_args()
    bw = copy_bandwidth(torch.device("cuda"))
    results: dict[str, object] = {}
    report: dict[str, object] = {
        "copy_bw_tb_per_s": bw / 1e12,
        "device": torch.cuda.get_device_name(),
        "note": NOTE,
        "results": results,
    }
    for fmt in args.formats.split(","):
        for batch, ctx in SHAPES:
            res = sweep_shape(fmt, batch, ctx, bw)
            torch.cuda.empty_cache()
            results[f"{fmt}/{batch}x{ctx}"] = res
            ok = [r for r in res if "ms" in r]
            best = min(ok, key=lambda r: r["ms"])
            print(
                f"{fmt} {batch}x{ctx}: best {best['ms']:.3f} ms (block_n {best['block_n']}, "
                f"stages {best['num_stages']}, warps {best['num_warps']}); "
                f"copy floor {best['floor_ms']:.3f} ms",
                flush=True,
            )
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
