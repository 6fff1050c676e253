"""Dense prefill attention against torch SDPA, one causal prompt per length.

    python -m sparsevllm.bench.prefill_kernels --lengths 8192,32768,131072 --json out.json

Llama-3-8B layer shapes (32 query heads, 8 KV heads, head_dim 128, bf16). Per length T:

* `sdpa`: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on contiguous
  [1, H, T, D] tensors, with torch's own backend choice (cuDNN on an H200), and its
  flash backend;
* our `prefill_attention` over the same prompt held in the KV pool: in randomly
  permuted slots (every tile reads the slot table), and in one run of consecutive slots
  (`contig_starts`: no table reads, TMA tiles on Hopper), each with the default tiles and
  the `--tiles` alternatives;
* the last chunk of `--chunk` queries over the whole view (a chunked prefill's step),
  through the one-run path, against the same rows of SDPA's output.

Every variant's output is checked against SDPA's (relative L2 error). Times are medians
of `triton.testing.do_bench`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparsevllm.attention.triton import prefill_attention

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


def median_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def causal_flops(q_len: int, view_len: int) -> float:
    """QK^T and PV FLOPs of q_len queries at the end of a view of view_len keys."""
    prefix = view_len - q_len
    keys_seen = q_len * prefix + q_len * (q_len + 1) / 2
    return 2 * 2 * HQ * D * keys_seen


def parse_tiles(text: str) -> list[dict[str, int]]:
    """ "256x64x8x4,128x128x8x3" -> tile option dicts (block_m x block_n x warps x stages)."""
    out = []
    for item in filter(None, text.split(",")):
        bm, bn, w, s = (int(x) for x in item.split("x"))
        out.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s))
    return out


def bench_length(seq: int, chunk: int, tiles: list[dict[str, int]]) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seq)
    q = torch.randn(seq, HQ, D, device=dev, dtype=DTYPE, generator=gen)  # [T, Hq, D]
    k = torch.randn(seq, HKV, D, device=dev, dtype=DTYPE, generator=gen)  # [T, Hkv, D]
    v = torch.randn(seq, HKV, D, device=dev, dtype=DTYPE, generator=gen)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, T, D]
    scale = D**-0.5

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

    def sdpa_flash() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa()

    ref = sdpa()[0].transpose(0, 1)  # [T, Hq, D]
    flops = causal_flops(seq, seq)
    rows: list[dict[str, Any]] = []

    def record(name: str, fn: Callable[[], Any], out: torch.Tensor, want: torch.Tensor, f: float):
        out.fill_(float("nan"))
        fn()
        err = rel_err(out, want)
        ms = median_ms(fn)
        rows.append(dict(variant=name, ms=ms, tflops=f / ms / 1e9, rel_err_vs_sdpa=err))

    for name, fn in (("sdpa (torch's choice)", sdpa), ("sdpa flash", sdpa_flash)):
        ms = median_ms(fn)
        err = rel_err(fn()[0].transpose(0, 1), ref)
        rows.append(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, rel_err_vs_sdpa=err))
    sdpa_ms = rows[0]["ms"]

    # The prompt in the pool: permuted slots (table reads), and one run from slot 0.
    perm = torch.randperm(seq, device=dev, generator=gen)
    k_perm, v_perm = torch.empty_like(k), torch.empty_like(v)
    k_perm[perm], v_perm[perm] = k, v
    table_perm = perm.to(torch.int32).view(1, seq)
    table_run = torch.arange(seq, dtype=torch.int32, device=dev).view(1, seq)
    row0 = torch.zeros(1, dtype=torch.int32, device=dev)
    lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    run_start = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def ours(q_part, kc, vc, table, starts, res, **kw):  # type: ignore[no-untyped-def]
        n = q_part.shape[0]
        q_starts = torch.tensor([0, n], dtype=torch.int32, device=dev)
        return lambda: prefill_attention(
            q_part, kc, vc, table, row0, q_starts, lens, scale, res, n,
            contig_starts=starts, **kw,
        )  # fmt: skip

    for cfg in [{}] + tiles:
        label = "default tiles" if not cfg else "x".join(str(x) for x in cfg.values())
        record(
            f"ours, permuted slots, {label}",
            ours(q, k_perm, v_perm, table_perm, None, out, **cfg),
            out,
            ref,
            flops,
        )
        record(f"ours, one run, {label}", ours(q, k, v, table_run, run_start, out, **cfg), out, ref, flops)  # fmt: skip
    if 0 < chunk < seq:
        tail = out[-chunk:]
        record(f"ours, one run, last chunk of {chunk}", ours(q[-chunk:], k, v, table_run, run_start, tail), tail, ref[-chunk:], causal_flops(chunk, seq))  # fmt: skip
    for r in rows:
        r["vs_sdpa"] = sdpa_ms / r["ms"] if "chunk" not in r["variant"] else None
    return dict(seq=seq, flops=flops, sdpa_ms=sdpa_ms, rows=rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths, comma-separated")
    p.add_argument(
        "--chunk", type=int, default=8192, help="queries of the last-chunk case (0: skip)"
    )
    p.add_argument(
        "--tiles",
        default="",
        help="extra tile options of our kernel, BMxBNxWARPSxSTAGES, comma-separated",
    )
    p.add_argument("--json", help="write every row here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_kernels needs a CUDA GPU")
    tiles = parse_tiles(args.tiles)
    report = [bench_length(int(n), args.chunk, tiles) for n in args.lengths.split(",")]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, lengths=report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(result["device"], "torch", result["torch"])
    for entry in report:
        print(f"\nT={entry['seq']}")
        for r in entry["rows"]:
            ratio = "" if r.get("vs_sdpa") is None else f" {r['vs_sdpa']:.3f}x sdpa"
            print(
                f"  {r['variant']:<46} {r['ms']:9.3f} ms {r['tflops']:7.1f} TF/s"
                f" err {r['rel_err_vs_sdpa']:.1e}{ratio}"
            )


if __name__ == "__main__":
    main()
