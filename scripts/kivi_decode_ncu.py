"""Two launches of each KIVI decode fast-loop variant at 64 x 8K (Llama-3-8B layer
shapes, int4, G 32, R 128), for Nsight Compute:

    ncu --clock-control none -k regex:_kivi_decode_kernel --launch-skip 1 --launch-count 3 \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python scripts/kivi_decode_ncu.py sequential

Launch order: the query-scaling fast loop twice, then the key-dequantizing one (the
default) twice; `--launch-skip 1` skips the first launch of the first.
"""

from __future__ import annotations

import sys

import torch

from sparsevllm.attention.triton.decode_kivi import kivi_decode_attention
from sparsevllm.bench.kivi_kernels import build


def main() -> None:
    permuted = len(sys.argv) > 1 and sys.argv[1] == "permuted"
    batch, ctx = 64, 8192
    built = build("int4", batch, ctx, 32, 128, permuted)
    storage, table = built["storage"], built["table"]
    buffers = storage.buffers()
    device = table.device
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    for dequant_keys in (False, True):
        for _ in range(2):
            kivi_decode_attention(
                q, buffers["k"], buffers["v"], buffers["v_params"], buffers["state"],
                storage.key_groups, storage.res_k, storage.res_v, table, rows, lens,
                128**-0.5, out, bits=4, block_n=32, dequant_keys=dequant_keys,
            )  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
