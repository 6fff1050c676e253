"""Diagnostic for DeltaKV's quality gap: keep the worst-reconstructed tokens in full
precision and see how much of the loss they carry.

Runs any `sparsevllm` command (normally `bench quality` with `--methods deltakv`) with
the method's prompt-side compression changed: each token's key is reconstructed right
after it is encoded (INT4 code, references' mean), and a token whose relative key error
|k^ - k| / |k| exceeds `--tau` is left uncompressed (it keeps its full row). The pool
gets rows for every slot (`CENTER_SLACK`), so kept tokens never run out of rows; the
KV bytes this costs are the kept fraction of full rows, printed at exit with quantiles
of the error. Decode-time compression (one token per step at the committed configs'
`deltakv_compress_interval` 1) is unchanged.

This is an experiment, not a serving mode: the row budget of a real "keep the worst"
rule, and the host syncs this filter takes, are not what the method ships.

    python scripts/deltakv_keep_worst.py --tau 0.14 -- bench quality --model GEMMA.gguf \
        --tasks niah_single --lengths 4096 --samples 20 --methods deltakv \
        --config docs/quality/deltakv_cpu/config_r256_recent16.json --dtype float32 \
        --device cpu --max-num-seqs 20 --json out.json
"""

from __future__ import annotations

import argparse
import atexit
import sys

import torch

import sparsevllm.kv.deltakv as deltakv_storage
import sparsevllm.sparse.deltakv as deltakv_method
from sparsevllm.sparse.deltakv_codec import nearest_centers

ERRORS: list[torch.Tensor] = []  # per compressed batch: relative key errors [n]
KEPT = {"kept": 0, "seen": 0}


def _keep_worst(tau: float):  # type: ignore[no-untyped-def]
    def compress_layer(self, layer, pos, slots, c_pos, c_slots):  # type: ignore[no-untyped-def]
        storage, codec = self.storages[layer], self.codecs[layer]
        xt = codec.vectors(*storage.read_full(slots), pos)  # [n, C]
        xc = codec.vectors(*storage.read_full(c_slots), c_pos)  # [M, C]
        idx = nearest_centers(xt, pos, xc, c_pos, self.info.spec.num_references, codec.shard)
        codes = codec.encode(codec.shard.compress(layer, xt, xc[idx]))
        rebuilt = codec.shard.reconstruct(layer, codec.latents(codes), xc[idx]).float()
        keys = slice(0, xt.shape[1] // 2)  # the vectors' key half (compressor.join_kv)
        err = (rebuilt[:, keys] - xt[:, keys]).norm(dim=1) / xt[:, keys].norm(dim=1).clamp_min(1e-6)
        ERRORS.append(err.cpu())
        ok = err <= tau  # [n]: compressed; the others keep their full rows
        KEPT["kept"] += int((~ok).sum())
        KEPT["seen"] += int(ok.numel())
        refs, ref_pos = c_slots[idx], c_pos[idx]
        storage.compress(slots[ok], pos[ok], codes[ok], refs[ok], ref_pos[ok])

    return compress_layer


def _report(tau: float) -> None:
    if not ERRORS:
        return
    err = torch.cat(ERRORS)
    quant = {q: round(float(err.quantile(q)), 3) for q in (0.5, 0.8, 0.9, 0.95, 0.99)}
    frac = KEPT["kept"] / max(1, KEPT["seen"])
    print(
        f"keep-worst tau={tau}: kept {KEPT['kept']} of {KEPT['seen']} prompt tokens "
        f"({frac:.1%}) in full precision; relative key error quantiles {quant}",
        file=sys.stderr,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tau", type=float, required=True, help="relative key error above which a token stays full"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then a sparsevllm command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    # Rows for CENTER_SLACK / stride of the slots: 10 gives the committed checkpoints
    # (stride 10) a row for every slot.
    deltakv_storage.CENTER_SLACK = 10.0
    deltakv_method.DeltaKV._compress_layer = _keep_worst(args.tau)  # type: ignore[method-assign]
    # Every prompt chunk of more than one token takes _compress_layer (as when the
    # committed runs were made), not the batched search of short chunks.
    deltakv_method.BATCHED_TOKENS = 1
    atexit.register(_report, args.tau)
    from sparsevllm.cli import main as cli_main

    return cli_main(command)


if __name__ == "__main__":
    sys.exit(main())
