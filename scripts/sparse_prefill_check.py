"""GPU check of block-sparse prefill (prefill_sparse_method=vertical_slash), one layer.

    PYTHONPATH=src python scripts/sparse_prefill_check.py --out F.json

(a) correctness: the Triton sparse kernel (with the estimated selection) vs the torch
    reference (attend_block_sparse, fp32) on a 16K view: max abs error;
(b) timing, Llama-3-8B layer shapes (Hq 32, Hkv 8, D 128, bf16, contiguous slots):
    dense `prefill_attention` vs estimation (block_mass + select_blocks) + the sparse
    kernel, for a chunk at the end of a 32K and a 128K view (8192 and 2048 queries, the
    engine's default chunk) and the whole 32K prompt as one chunk; with the selection's
    density (visited / causal key blocks). Random K/V spread attention evenly, so the
    selection is scattered: the kernel's worst case, as with dummy weights.

Times are triton.testing.do_bench medians in milliseconds; JSON goes to --out and stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

import torch
from triton.testing import do_bench

from sparsevllm.attention import sparse_prefill as sp
from sparsevllm.attention.triton import prefill_attention
from sparsevllm.attention.triton.prefill_sparse import block_mass, prefill_sparse_attention

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
DEV = torch.device("cuda")


def bench(fn: Callable[[], object]) -> float:
    return float(do_bench(fn, warmup=10, rep=100, return_mode="median"))


def make_case(view_len: int, q_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(view_len + 1, HKV, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(view_len + 1, HKV, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    q = torch.randn(q_len, HQ, D, device=DEV, generator=gen, dtype=torch.bfloat16)
    table = (torch.arange(view_len, device=DEV, dtype=torch.int32) + 1)[None]  # slot 0 unused
    return dict(q=q, k=k, v=v, table=table)


def estimate(c: dict[str, torch.Tensor], view_len: int, cfg: sp.PrefillSparsity):
    q = c["q"]
    mass = block_mass(q[-cfg.last_q :], c["k"], c["table"][0], view_len, SCALE, cfg.block_n)
    return sp.select_blocks(mass, q.shape[0], view_len, cfg)


def sparse_run(c, view_len, cfg, out, count_index=None):
    count, index = count_index or estimate(c, view_len, cfg)
    q = c["q"]
    prefill_sparse_attention(
        q, c["k"], c["v"], c["table"][0], view_len, SCALE, count, index, out,
        block_m=cfg.block_m, block_n=cfg.block_n,
    )  # fmt: skip
    return out


def dense_run(c, view_len, out):
    q = c["q"]
    rows = torch.zeros(1, dtype=torch.int32, device=DEV)
    starts = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=DEV)
    lens = torch.tensor([view_len], dtype=torch.int32, device=DEV)
    prefill_attention(q, c["k"], c["v"], c["table"], rows, starts, lens, SCALE, out, q.shape[0])
    return out


def check_correctness(cfg: sp.PrefillSparsity, view_len: int = 16384, q_len: int = 1024):
    c = make_case(view_len, q_len, seed=1)
    count, index = estimate(c, view_len, cfg)
    out = sparse_run(c, view_len, cfg, torch.empty_like(c["q"]), (count, index))
    view = c["table"][0].long()
    ref = sp.attend_block_sparse(
        c["q"].float(), c["k"][view].float(), c["v"][view].float(), SCALE, count, index,
        cfg.block_m, cfg.block_n,
    )  # fmt: skip
    dense = dense_run(c, view_len, torch.empty_like(c["q"]))
    return {
        "view_len": view_len,
        "q_len": q_len,
        "max_abs_err_vs_reference": (out.float() - ref).abs().max().item(),
        "max_abs_diff_vs_dense": (out.float() - dense.float()).abs().max().item(),
        "density": sp.density(count.cpu(), q_len, view_len, cfg),
    }


def time_case(view_len: int, q_len: int, cfg: sp.PrefillSparsity) -> dict[str, float | int]:
    c = make_case(view_len, q_len)
    out = torch.empty_like(c["q"])
    count, index = estimate(c, view_len, cfg)
    dense_ms = bench(lambda: dense_run(c, view_len, out))
    est_ms = bench(lambda: estimate(c, view_len, cfg))
    kernel_ms = bench(lambda: sparse_run(c, view_len, cfg, out, (count, index)))
    total_ms = bench(lambda: sparse_run(c, view_len, cfg, out))
    causal_flops = 4.0 * HQ * D * q_len * (view_len - q_len / 2)
    density = sp.density(count.cpu(), q_len, view_len, cfg)
    return {
        "view_len": view_len,
        "q_len": q_len,
        "dense_ms": dense_ms,
        "estimate_ms": est_ms,
        "sparse_kernel_ms": kernel_ms,
        "sparse_total_ms": total_ms,
        "speedup": dense_ms / total_ms,
        "density": density,
        "dense_tflops": causal_flops / dense_ms / 1e9,
        "sparse_kernel_tflops": causal_flops * density / kernel_ms / 1e9,
        "max_blocks_per_query_block": int(count.max().item()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--vertical-blocks", type=int, default=sp.PrefillSparsity.vertical_blocks)
    p.add_argument("--slash-blocks", type=int, default=sp.PrefillSparsity.slash_blocks)
    p.add_argument("--last-q", type=int, default=sp.PrefillSparsity.last_q)
    p.add_argument(
        "--block-m", type=int, nargs="+", default=[sp.BLOCK_M], help="query tiles to compare"
    )
    args = p.parse_args()
    base = sp.PrefillSparsity(
        vertical_blocks=args.vertical_blocks, slash_blocks=args.slash_blocks, last_q=args.last_q
    )
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "settings": {}}
    for block_m in args.block_m:
        cfg = dataclasses.replace(base, block_m=block_m)
        cases = [(32768, 8192), (32768, 32768), (131072, 8192), (131072, 2048)]
        report["settings"][f"block_m_{block_m}"] = {  # type: ignore[index]
            "config": dataclasses.asdict(cfg),
            "correctness_16k": check_correctness(cfg),
            "timing": [time_case(view, n, cfg) for view, n in cases],
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
