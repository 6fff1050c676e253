"""MLA prefill chunks on CUDA: the absorbed form (one KV head over the latent rows, what
decode attends with) against the expanded form (rows up-projected per head, flash SDPA;
attention/latent_expansion.py), at GLM-4.7-Flash's shapes in bf16.

For chunks of n queries over views of L rows (the chunk's own rows last), it reports
each form's time (the absorbed one with its value projection W_uv, the expanded one
with its up-projection), their ratio, the difference of their outputs, and the smallest
n from which the expanded form is faster at every measured L: the rule that
`MIN_EXPANDED_QUERIES` follows.

    PYTHONPATH=src python scripts/mla_prefill_check.py --out mla_prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import triton

from sparsevllm.attention.latent_expansion import LatentExpansion
from sparsevllm.attention.torch_ref import attend

HEADS, RANK, ROPE, NOPE, VDIM = 20, 512, 64, 192, 256  # GLM-4.7-Flash
SCALE = (NOPE + ROPE) ** -0.5


def make_chunk(n: int, length: int, seed: int = 0) -> tuple[LatentExpansion, torch.Tensor]:
    """Random un-absorbed queries, up-projections and latent rows (unit scale, as after
    kv_a_layernorm) for one chunk of n queries over a view of `length` rows."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * std).bfloat16()

    q_nope, q_pe = randn(n, HEADS, NOPE), randn(n, HEADS, ROPE)
    w_uk = randn(HEADS, NOPE, RANK, std=RANK**-0.5)
    w_uv = randn(HEADS, VDIM, RANK, std=RANK**-0.5)
    rows = randn(length, 1, RANK + ROPE)
    return LatentExpansion(q_nope, q_pe, w_uk, w_uv), rows


def absorbed(exp: LatentExpansion, rows: torch.Tensor) -> torch.Tensor:  # [n, H, Dv]
    """The absorbed form as the reference backend runs it, then W_uv."""
    q_abs = torch.einsum("thn,hnr->thr", exp.q_nope, exp.w_uk)  # [n, H, R]
    q = torch.cat([q_abs, exp.q_pe], dim=-1)  # [n, H, R + P]
    return exp.values(attend(q, rows, rows[..., :RANK], SCALE))


def expanded(exp: LatentExpansion, rows: torch.Tensor) -> torch.Tensor:  # [n, H, Dv]
    return exp.attend(0, exp.q_nope.shape[0], rows, SCALE)


def ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=5, rep=40))


def measure(n: int, length: int) -> dict[str, Any]:
    exp, rows = make_chunk(n, length)
    a, e = absorbed(exp, rows).float(), expanded(exp, rows).float()
    err = float((a - e).abs().max())
    t_abs, t_exp = ms(lambda: absorbed(exp, rows)), ms(lambda: expanded(exp, rows))
    return {
        "queries": n,
        "view_len": length,
        "absorbed_ms": round(t_abs, 4),
        "expanded_ms": round(t_exp, 4),
        "expanded_speedup": round(t_abs / t_exp, 3),
        "max_abs_diff": err,
        "max_abs_value": float(a.abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: stdout only)")
    parser.add_argument("--queries", default="16,32,64,128,256,512,1024,2048", help="chunk sizes n")
    parser.add_argument(
        "--views", default="0,4096,16384,32768", help="view lengths L (0: L = n, a first chunk)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    rows = []
    for n in (int(x) for x in args.queries.split(",")):
        for view in (int(x) for x in args.views.split(",")):
            if view and view < n:
                continue
            rows.append(measure(n, view or n))
            print(json.dumps(rows[-1]), flush=True)
    wins = sorted({r["queries"] for r in rows})
    faster_from = next(
        (q for q in wins if all(r["expanded_speedup"] > 1 for r in rows if r["queries"] >= q)),
        None,
    )
    result = {
        "device": torch.cuda.get_device_name(),
        "shapes": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "nope": NOPE, "v": VDIM},
        "dtype": "bfloat16",
        "rows": rows,
        "expanded_faster_from_queries": faster_from,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({"expanded_faster_from_queries": faster_from}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
