"""Compare DeltaKV reference rules on a capture: how much of each compressed token the
references alone explain (the `references` rows of `sparsevllm deltakv eval`), for the
rule the compressor uses (the R nearest centers before the token in L2, over the whole
history) against the R centers just before the token (no search, no stored indices).

    PYTHONPATH=src python scripts/deltakv_reference_rule.py DATA_DIR [--sequences N]

Prints, per rule, the mean over layers of the relative K and V errors of x_hat = mean of
the references (docs/methods.md, DeltaKV: why the rule searches).
"""

from __future__ import annotations

import argparse

import torch

from sparsevllm.deltakv.centers import center_positions, compressed_positions, select_references
from sparsevllm.deltakv.compressor import join_kv, reference_mean


def preceding(length: int, sink: int, stride: int, k: int) -> torch.Tensor:
    """The k centers just before each compressed token `[N, k]`."""
    centers = center_positions(length, sink, stride)
    targets = compressed_positions(length, sink, stride)
    last = torch.searchsorted(centers, targets) - 1  # index of the last center before t
    idx = (last[:, None] - torch.arange(k)[None, :]).clamp_min(0)
    return centers[idx]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("data")
    p.add_argument("--sequences", type=int, default=12)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--stride", type=int, default=10)
    p.add_argument("--references", type=int, default=4)
    args = p.parse_args()
    from sparsevllm.deltakv_tools.capture_set import open_capture

    cap = open_capture(args.data)
    seqs = cap.load(cap.sequences[: args.sequences])
    half = cap.layout.num_kv_heads * cap.layout.head_dim
    sums = {rule: torch.zeros(len(cap.layout.layers), 4, dtype=torch.float64) for rule in ("l2", "preceding")}
    for seq in seqs:
        for i, layer in enumerate(cap.layout.layers):
            x = join_kv(seq.keys[layer].float(), seq.values[layer].float())
            comp = compressed_positions(x.shape[0], args.sink, args.stride)
            target = x[comp]
            for rule, refs in (
                ("l2", select_references(x, args.sink, args.stride, args.references)),
                ("preceding", preceding(x.shape[0], args.sink, args.stride, args.references)),
            ):
                err = (reference_mean(x[refs]) - target) ** 2
                sums[rule][i] += torch.tensor(
                    [err[:, :half].sum(), (target[:, :half] ** 2).sum(),
                     err[:, half:].sum(), (target[:, half:] ** 2).sum()], dtype=torch.float64
                )  # fmt: skip
    for rule, s in sums.items():
        k, v = (s[:, 0] / s[:, 1]).mean(), (s[:, 2] / s[:, 3]).mean()
        print(f"{rule:>9}: K {100 * k:.2f}%  V {100 * v:.2f}%  (mean over {len(s)} layers)")


if __name__ == "__main__":
    main()
