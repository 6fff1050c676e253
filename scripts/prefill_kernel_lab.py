"""Where the dense prefill kernel stands against torch SDPA, and which Hopper features
close the gap (H200; issue 22 item 5).

    PYTHONPATH=src python scripts/prefill_kernel_lab.py --json out.json

One causal prompt (the chunk is the whole prompt; Llama-3-8B layer shapes: Hq 32, Hkv 8,
D 128, bf16) at each --lengths, timed with do_bench medians:

* the engine's kernel (`prefill_attention`) over permuted and over identity slot tables;
* a lab kernel over contiguous K/V with the same online softmax, loading K/V with plain
  pointers, or with TMA tensor descriptors, with and without Triton's warp
  specialisation of the key loop, over several tiles;
* SDPA: the default choice, and each backend it has (flash, cuDNN, memory-efficient).

Every variant is checked against SDPA's output (relative L2 error) on fresh random
inputs; a variant that fails to compile or run is reported with its error, not dropped.
"""

from __future__ import annotations

import argparse
import json
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from sparsevllm.attention.triton import prefill_attention

HQ, HKV, D = 32, 8, 128
LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, qk_scale, q_pos, offs, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]
    qk = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
    if MASKED:
        qk = tl.where(offs[None, :] <= q_pos[:, None], qk * qk_scale, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])  # one FMA per element
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _lab_kernel(  # type: ignore[no-untyped-def]
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    num_mb,
    qk_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    WS: tl.constexpr,
):
    h = tl.program_id(0)
    mb = num_mb - 1 - tl.program_id(1)  # heaviest query blocks first
    kvh = h // (HQ // HKV)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    if TMA:
        q = q_desc.load([mb * BLOCK_M, h * D])
    else:
        q = tl.load(q_ptr + offs_m[:, None] * (HQ * D) + h * D + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = mb * BLOCK_M // BLOCK_N * BLOCK_N
    hi = (mb + 1) * BLOCK_M
    for j in tl.range(0, full_end, BLOCK_N, warp_specialize=WS):
        if TMA:
            k = k_desc.load([j, kvh * D])
            v = v_desc.load([j, kvh * D])
        else:
            rows = (j + offs_n)[:, None] * (HKV * D) + kvh * D + offs_d[None, :]
            k = tl.load(k_ptr + rows)
            v = tl.load(v_ptr + rows)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, offs_m, j + offs_n, False)
    for j in tl.range(full_end, hi, BLOCK_N, warp_specialize=WS):
        if TMA:
            k = k_desc.load([j, kvh * D])
            v = v_desc.load([j, kvh * D])
        else:
            rows = (j + offs_n)[:, None] * (HKV * D) + kvh * D + offs_d[None, :]
            k = tl.load(k_ptr + rows)
            v = tl.load(v_ptr + rows)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, qk_scale, offs_m, j + offs_n, True)
    o = (acc / l_i[:, None]).to(q.dtype)
    if TMA:
        o_desc.store([mb * BLOCK_M, h * D], o)
    else:
        tl.store(o_ptr + offs_m[:, None] * (HQ * D) + h * D + offs_d[None, :], o)


def lab_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cfg: dict[str, Any]
) -> Callable[[], None]:
    """A launcher of the lab kernel (prompt length a multiple of block_m)."""
    seq = q.shape[0]
    bm, bn = cfg["block_m"], cfg["block_n"]
    q2, o2 = q.view(seq, HQ * D), out.view(seq, HQ * D)
    k2, v2 = k.view(seq, HKV * D), v.view(seq, HKV * D)
    descs = (
        TensorDescriptor.from_tensor(q2, [bm, D]),
        TensorDescriptor.from_tensor(k2, [bn, D]),
        TensorDescriptor.from_tensor(v2, [bn, D]),
        TensorDescriptor.from_tensor(o2, [bm, D]),
    )
    grid = (HQ, seq // bm)

    def run() -> None:
        _lab_kernel[grid](
            *descs, q2, k2, v2, o2, seq // bm, D**-0.5 * LOG2E,
            HQ=HQ, HKV=HKV, D=D, BLOCK_M=bm, BLOCK_N=bn, TMA=cfg["tma"], WS=cfg["ws"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip

    return run


def median_ms(fn: Callable[[], Any]) -> float:
    return float(do_bench(fn, warmup=25, rep=150, return_mode="median"))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


LAB_TILES = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (256, 64, 8, 3), (128, 128, 8, 2)]


def bench_length(seq: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn(seq, HQ, D, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(seq, HKV, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(seq, HKV, D, device=device, dtype=torch.bfloat16, generator=gen)
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T, D] views
    qs = qs.contiguous()
    ks_rep = ks.repeat_interleave(HQ // HKV, dim=1).contiguous()
    vs_rep = vs.repeat_interleave(HQ // HKV, dim=1).contiguous()
    ks, vs = ks.contiguous(), vs.contiguous()
    flops = 2 * 2 * HQ * D * seq * (seq + 1) / 2
    ref = F.scaled_dot_product_attention(qs, ks_rep, vs_rep, is_causal=True)[0].transpose(0, 1)
    rows: list[dict[str, Any]] = []

    def record(name: str, fn: Callable[[], Any], out: torch.Tensor | None) -> None:
        try:
            if out is not None:
                out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = rel_err(out, ref) if out is not None else None
            ms = median_ms(fn)
            rows.append(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, rel_err=err))
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result
            rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:400]))
            traceback.print_exc()

    def sdpa(backend: SDPBackend | None, gqa: bool) -> Callable[[], torch.Tensor]:
        kk, vv = (ks, vs) if gqa else (ks_rep, vs_rep)

        def fn() -> torch.Tensor:
            if backend is None:
                return F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, enable_gqa=gqa)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, kk, vv, is_causal=True, enable_gqa=gqa)

        return fn

    for backend, bname in ((None, "default"), (SDPBackend.FLASH_ATTENTION, "flash"),
                           (SDPBackend.CUDNN_ATTENTION, "cudnn"),
                           (SDPBackend.EFFICIENT_ATTENTION, "efficient")):  # fmt: skip
        for gqa in (True, False):
            if seq > 65536 and backend == SDPBackend.EFFICIENT_ATTENTION:
                continue
            fn = sdpa(backend, gqa)
            name = f"sdpa {bname}{' gqa' if gqa else ' repeated kv'}"
            try:
                err = rel_err(fn()[0].transpose(0, 1), ref)
                ms = median_ms(fn)
                rows.append(dict(variant=name, ms=ms, tflops=flops / ms / 1e9, rel_err=err))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:400]))

    out = torch.empty_like(q)
    perm = torch.randperm(seq, device=device, generator=gen)
    k_cache, v_cache = torch.empty_like(k), torch.empty_like(v)
    k_cache[perm], v_cache[perm] = k, v
    table = perm.to(torch.int32).view(1, seq)
    ident = torch.arange(seq, dtype=torch.int32, device=device).view(1, seq)
    meta = (
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.tensor([0, seq], dtype=torch.int32, device=device),
        torch.tensor([seq], dtype=torch.int32, device=device),
    )
    for tab, kc, vc, tname in ((table, k_cache, v_cache, "permuted"), (ident, k, v, "identity")):
        record(
            f"engine kernel, {tname} slots",
            lambda tab=tab, kc=kc, vc=vc: prefill_attention(
                q, kc, vc, tab, *meta, D**-0.5, out, seq
            ),
            out,
        )
    for bm, bn, warps, stages in LAB_TILES:
        for tma, ws in ((False, False), (True, False), (True, True)):
            cfg = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, tma=tma, ws=ws)
            name = f"lab {'tma' if tma else 'ptr'}{' ws' if ws else ''} {bm}x{bn} w{warps} s{stages}"
            try:
                fn = lab_attention(q, k, v, out, cfg)
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(variant=name, error=f"{type(exc).__name__}: {exc}"[:400]))
                continue
            record(name, fn, out)
    return dict(seq=seq, flops=flops, rows=rows)


def _alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, device="cuda", dtype=torch.int8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,32768,131072", help="prompt lengths")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    report = [bench_length(int(n), device) for n in args.lengths.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), lengths=report), f, indent=1)
    for entry in report:
        print(f"\nT={entry['seq']}")
        for row in entry["rows"]:
            if "error" in row:
                print(f"  {row['variant']:<40} ERROR {row['error'][:150]}")
            else:
                err = "" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
                print(f"  {row['variant']:<40} {row['ms']:9.3f} ms {row['tflops']:7.1f} TF/s {err}")


if __name__ == "__main__":
    main()
