"""MLA decode kernel (attention/triton/decode_mla.py) on CUDA: accuracy at full size and
speed against the torch reference decode and the byte floor.

(a) the kernel against the reference attention over the same latent storage at
    GLM-4.7-Flash's shapes (20 heads, kv_lora_rank 512, rope 64, bf16 rows and int8 /
    fp8 rows), ragged views with splits, scores and a subset: max abs and relative error;
(b) decode time at batch 64 x 8K and 8 x 32K: the kernel (default tiles and splits,
    and with --sweep a grid of tiles), the reference backend's batched decode (gather
    the rows, SDPA) and the byte floor (latent bytes read / 4.8e12 B/s).

    PYTHONPATH=src python scripts/mla_decode_check.py --out mla_decode.json [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

from sparsevllm.attention import torch_ref
from sparsevllm.attention.triton.decode_mla import decode_mla_attention, mla_decode_config
from sparsevllm.kv.latent import LatentStorage
from sparsevllm.kv.layout import latent_layout
from sparsevllm.kv.registry import create_storage, get_format

HBM_BYTES_PER_S = 4.8e12  # H200
SCALE = 192**-0.5 * 0.6  # of the order of GLM-4.7-Flash's


def make_views(
    fmt: str, heads: int, lens: list[int], rank: int, rope: int, seed: int = 0
) -> tuple[LatentStorage, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent storage holding `lens` views at randomly permuted slots (latent rows of
    unit scale, as after kv_a_layernorm), the table, rows, view lengths and bf16 queries."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)
    layout = latent_layout(rank, rope)
    storage = create_storage(get_format(fmt), total, layout, torch.bfloat16, torch.device("cuda"))
    slots = torch.randperm(total, device="cuda", generator=gen)
    for lo in range(0, total, 1 << 18):  # in pieces: bounded float32 temporaries
        hi = min(total, lo + (1 << 18))
        x = torch.randn(hi - lo, 1, rank + rope, device="cuda", generator=gen)
        storage.store(x.bfloat16(), x[..., :rank].bfloat16(), slots[lo:hi])
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device="cuda")
    offset = 0
    for i, n in enumerate(lens):
        table[i, :n] = slots[offset : offset + n]
        offset += n
    rows = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), heads, rank + rope, device="cuda", generator=gen).bfloat16()
    assert isinstance(storage, LatentStorage)
    return storage, table, rows, lens_t, q


def reference(
    storage: LatentStorage,
    table: torch.Tensor,
    lens: torch.Tensor,
    q: torch.Tensor,  # [S, H, R + P]
    subset: torch.Tensor | None = None,  # [S, 1, B]
    counts: torch.Tensor | None = None,  # [S]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention and probabilities per sequence over the stored values."""
    s, h = q.shape[:2]
    out = torch.empty(s, h, storage.v.shape[-1], device="cuda")
    probs = torch.zeros(s, h, table.shape[1], device="cuda")
    for i, n in enumerate(lens.tolist()):
        view = table[i, :n].long()
        read = torch.arange(n, device="cuda")
        if subset is not None and counts is not None and int(counts[i]) >= 0:
            read = torch.cat([subset[i, 0, : int(counts[i])].long(), read[-1:]])
        k = storage.k[view[read]].float()  # [n, 1, R + P], dequantized in float32
        if storage.k_scale is not None:
            k = k * storage.k_scale[view[read]][..., None]
        v = k[..., : storage.v.shape[-1]]
        qi = q[i : i + 1].float()
        out[i] = torch_ref.attend(qi, k, v, SCALE)[0]
        probs[i][:, read] = torch_ref.attention_mass(qi, k, SCALE)
    return out, probs


def accuracy(fmt: str, heads: int, rank: int, rope: int) -> dict[str, Any]:
    lens = [8192, 3000, 257, 33, 1]
    storage, table, rows, lens_t, q = make_views(fmt, heads, lens, rank, rope, seed=1)
    out = torch.empty(len(lens), heads, rank, dtype=torch.bfloat16, device="cuda")
    scores = torch.empty(len(lens), heads, table.shape[1], device="cuda")
    # A subset for every sequence but the last two: every 3rd position.
    subset = torch.zeros(len(lens), 1, max(lens), dtype=torch.int32, device="cuda")
    counts = torch.full((len(lens),), -1, dtype=torch.int32, device="cuda")
    for i, n in enumerate(lens[:3]):
        picks = torch.arange(0, n - 1, 3, dtype=torch.int32, device="cuda")
        subset[i, 0, : len(picks)] = picks
        counts[i] = len(picks)
    result: dict[str, Any] = {"format": fmt, "heads": heads, "lens": lens}
    for name, kw in (("whole", {}), ("subset", {"subset": subset, "subset_lens": counts})):
        decode_mla_attention(
            q, storage.k, table, rows, lens_t, SCALE, out, kv_scale=storage.k_scale,
            scores_out=scores, **kw,
        )  # fmt: skip
        want, probs = reference(storage, table, lens_t, q, kw.get("subset"), kw.get("subset_lens"))
        err = (out.float() - want).abs()
        result[name] = {
            "max_abs_err": float(err.max()),
            "rel_err": float(err.norm() / want.norm()),
            "scores_max_abs_err": float((scores - probs).abs().max()),
        }
    return result


class _Views:
    """The one ForwardBatch method the reference's batched decode reads."""

    def __init__(self, table: torch.Tensor, lens: torch.Tensor) -> None:
        cols = torch.arange(table.shape[1], device="cuda")
        self.real = cols[None, :] < lens[:, None]  # [S, Lmax]
        self.slots = torch.where(self.real, table.long(), 0)

    def padded_views(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots, self.real


def bench(fn: Any) -> float:
    """Median microseconds of `fn` replayed from a CUDA graph (as the engine decodes;
    eagerly if it cannot be captured)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except RuntimeError:
        run = fn
    return float(triton.testing.do_bench(run, warmup=10, rep=60)) * 1e3


def timing(
    fmt: str, heads: int, batch: int, length: int, rank: int, rope: int, sweep: bool
) -> dict[str, Any]:
    storage, table, rows, lens, q = make_views(fmt, heads, [length] * batch, rank, rope)
    out = torch.empty(batch, heads, rank, dtype=torch.bfloat16, device="cuda")
    row_bytes = storage.k.shape[-1] * storage.k.element_size() + (
        4 if storage.k_scale is not None else 0
    )
    floor_us = batch * length * row_bytes / HBM_BYTES_PER_S * 1e6

    def kernel(**kw: Any) -> None:
        decode_mla_attention(
            q, storage.k, table, rows, lens, SCALE, out, kv_scale=storage.k_scale, **kw
        )

    block_h, block_n, splits = mla_decode_config(
        batch, heads, table.shape[1], q.device, storage.k.element_size()
    )
    kernel_us = bench(kernel)
    views = _Views(table, lens)
    ref_us = bench(
        lambda: torch_ref.attend_decode_batch(q, storage, views, 0, SCALE, None)  # type: ignore[arg-type]
    )
    result: dict[str, Any] = {
        "format": fmt, "heads": heads, "batch": batch, "length": length,
        "default_config": {"block_h": block_h, "block_n": block_n, "num_splits": splits},
        "kernel_us": kernel_us, "reference_us": ref_us, "floor_us": floor_us,
        "kernel_over_floor": kernel_us / floor_us, "reference_over_kernel": ref_us / kernel_us,
    }  # fmt: skip
    if sweep:
        result["sweep"] = _sweep(kernel, floor_us)
    return result


def _sweep(kernel: Any, floor_us: float) -> list[dict[str, Any]]:
    grid = itertools.product((16, 32), (16, 32, 64), (None, 8, 16, 32), (4, 8), (1, 2, 3))
    rows = []
    for block_h, block_n, splits, warps, stages in grid:
        cfg = dict(block_h=block_h, block_n=block_n, num_splits=splits, num_warps=warps,
                   num_stages=stages)  # fmt: skip
        try:
            us = bench(lambda cfg=cfg: kernel(**cfg))
        except Exception as err:  # out of shared memory or registers: skip the tile
            rows.append({**cfg, "error": str(err)[:120]})
            continue
        rows.append({**cfg, "us": us, "over_floor": us / floor_us})
    return sorted(rows, key=lambda r: r.get("us", float("inf")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--heads", type=int, default=20, help="query heads (GLM-4.7-Flash: 20)")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--formats", default="auto,int8,fp8_e4m3")
    ap.add_argument("--shapes", default="64x8192,8x32768", help="BATCHxLENGTH,...")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    formats = args.formats.split(",")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "accuracy": [accuracy(f, args.heads, args.rank, args.rope) for f in formats],
        "timing": [],
    }
    for fmt, shape in itertools.product(formats, args.shapes.split(",")):
        batch, length = (int(x) for x in shape.split("x"))
        report["timing"].append(
            timing(fmt, args.heads, batch, length, args.rank, args.rope, args.sweep)
        )
        torch.cuda.empty_cache()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
