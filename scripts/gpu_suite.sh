#!/usr/bin/env bash
# One GPU session: correctness first, then the timed benchmarks (writes JSON to $OUT).
# Usage on the device machine, from the repository root:  bash scripts/gpu_suite.sh PART
#   PART = tests | dense | long   (several parts: run them one after another)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
M="python -m sparsevllm.cli bench throughput --model-config llama3-8b"
for part in "$@"; do
  case $part in
    tests)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
      python -m pytest -q -x tests/gpu 2>&1 | tail -5 ;;
    dense)
      $M --prompt-len 8192 --output-len 128 --batch-size 32 --max-model-len 8448 \
         --compare hf --json "$OUT/dense_b32_8k_vs_hf.json" | tail -3
      $M --prompt-len 8192 --output-len 128 --batch-size 64 --max-model-len 8448 \
         --json "$OUT/dense_b64_8k.json" | tail -3 ;;
    long)
      $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --max-batch \
         --json "$OUT/vanilla_32k_maxbatch.json" | tail -3
      $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --max-batch \
         --sparse-method snapkv --decode-keep-tokens 2048 --max-num-seqs 64 \
         --json "$OUT/snapkv_32k_b64.json" | tail -3 ;;
  esac
done
