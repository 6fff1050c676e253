#!/usr/bin/env bash
# One GPU session: correctness first, then the timed benchmarks (writes JSON to $OUT).
# Usage on the device machine, from the repository root:  bash scripts/gpu_suite.sh PART
#   PART = tests | multiturn | dense | long | b24 | overlap | layout | prefill32k | profile | kvpress | sweep |
#          gguf-part | quality | quality-rerun | quality-modes | quality-formats | quality-prefill | formats-kernels | formats-throughput |
#          capacity-methods | formats-capacity | kivi-graphs | million | mla | deltakv-throughput |
#          deltakv-quality | deltakv-fused | deltakv-kernels | tp
#   (several parts: run them one after another)
set -u
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1  # /tmp/site: carried wheels (llguidance)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
M="python -m sparsevllm.cli bench throughput --model-config llama3-8b"
quality_grid() {
  # Issue 7's grid: Gemma-3-270M at 4K, every method at ratios 0.5/0.75/0.9; resumes
  # from the records already in $OUT.
  cat /tmp/g/part0* > /tmp/g/gemma-3-270m-q4_k_m.gguf && md5sum /tmp/g/*.gguf
  PYTHONPATH=src:/tmp/site python -m sparsevllm.cli bench quality \
     --model /tmp/g/gemma-3-270m-q4_k_m.gguf --lengths 4096 --samples 20 \
     --tasks niah_single,niah_multikey,variable_tracking --ratios 0.5,0.75,0.9 \
     --max-num-seqs 64 --enforce-eager --no-progress \
     --json "$OUT/quality_gemma3_270m_4k.json" --plot "$OUT/quality_gemma3_270m_4k.png" \
     | tail -40
}
quality_modes() {
  # Issue 18's grid: Gemma-3-270M at 4K, niah_single and niah_multikey, every method at
  # ratios 0.5/0.75/0.9 in both modes. Resumes from /tmp/q (seeded from .gguf_parts/ with
  # the query-aware records of the methods unchanged since issue 7's grid); stops before
  # the call's limit, so a second call continues.
  [ -f /tmp/g/gemma-3-270m-q4_k_m.gguf ] || cat /tmp/g/part0* > /tmp/g/gemma-3-270m-q4_k_m.gguf
  mkdir -p /tmp/q && [ -f /tmp/q/quality_gemma3_270m_4k_modes.jsonl ] ||
    cp .gguf_parts/quality_gemma3_270m_4k_modes.jsonl /tmp/q/
  PYTHONPATH=src:/tmp/site timeout "${QUALITY_LIMIT_S:-520}" python -m sparsevllm.cli bench quality \
     --model /tmp/g/gemma-3-270m-q4_k_m.gguf --tasks niah_single,niah_multikey \
     --lengths 4096 --samples 20 --ratios 0.5,0.75,0.9 --modes query_aware,query_agnostic \
     --max-num-seqs 128 --enforce-eager --no-progress \
     --json /tmp/q/quality_gemma3_270m_4k_modes.json --plot /tmp/q/quality_gemma3_270m_4k_modes.png \
     | tail -80
  cp /tmp/q/* "$OUT/"
}
quality_formats() {
  # Issue 15's grid: Gemma-3-270M at 4K, niah_single and niah_multikey, vanilla and SnapKV
  # at ratio 0.75, one report per KV storage format (each resumes from its records).
  [ -f /tmp/g/gemma-3-270m-q4_k_m.gguf ] || cat /tmp/g/a0 /tmp/g/b? > /tmp/g/gemma-3-270m-q4_k_m.gguf
  for f in ${FORMATS:-auto fp8_e4m3 int8 int4 int2}; do
    PYTHONPATH=src:/tmp/site python -m sparsevllm.cli bench quality \
       --model /tmp/g/gemma-3-270m-q4_k_m.gguf --tasks niah_single,niah_multikey \
       --lengths 4096 --samples 20 --methods vanilla,snapkv --ratios 0.75 --kv-cache-dtype "$f" \
       --max-num-seqs 64 --enforce-eager --no-progress \
       --json "$OUT/quality_gemma3_270m_4k_kv_$f.json" > "$OUT/quality_kv_$f.log" 2>&1
    tail -12 "$OUT/quality_kv_$f.log"
  done
}
quality_prefill() {
  # Issue 22 item 2: sparse prefill (vertical_slash in Gemma-3-270M's global layers, from
  # views of 1,024 tokens on) against dense prefill, vanilla decode, niah_single and
  # niah_multikey, 4K and 16K, 20 samples; one report per length and prefill
  # (QP_LENGTHS, QP_CONFIGS: docs/quality/prefill_sparse/config_<name>.json, or off).
  [ -f /tmp/g/gemma-3-270m-q4_k_m.gguf ] || cat /tmp/g/part0* > /tmp/g/gemma-3-270m-q4_k_m.gguf
  for len in ${QP_LENGTHS:-4096 16384}; do
    for p in ${QP_CONFIGS:-off vertical_slash vertical_slash_tight}; do
      cfg=""
      [ "$p" = off ] || cfg="--config docs/quality/prefill_sparse/config_$p.json"
      PYTHONPATH=src:/tmp/site python -m sparsevllm.cli bench quality \
         --model /tmp/g/gemma-3-270m-q4_k_m.gguf --tasks niah_single,niah_multikey \
         --lengths $len --samples 20 --methods vanilla $cfg \
         --max-num-seqs 64 --enforce-eager --no-progress \
         --json "$OUT/quality_prefill_${p}_$len.json" > "$OUT/quality_prefill_${p}_$len.log" 2>&1
      tail -6 "$OUT/quality_prefill_${p}_$len.log"
    done
  done
}
quality_deltakv() {
  # Issue 16 item 3: the Gemma compressor served at three recent windows (8,000: nothing
  # compressed, the control that must equal vanilla; 220: SnapKV 0.75's bytes; 16: the
  # smallest), niah_single and niah_multikey, 4K, 20 samples; DK_CONFIGS picks a subset.
  [ -f /tmp/g/gemma-3-270m-q4_k_m.gguf ] || cat /tmp/g/part0* > /tmp/g/gemma-3-270m-q4_k_m.gguf
  sha256sum /tmp/g/gemma-3-270m-q4_k_m.gguf
  for c in ${DK_CONFIGS:-none recent220 recent16}; do
    PYTHONPATH=src:/tmp/site python -m sparsevllm.cli bench quality \
       --model /tmp/g/gemma-3-270m-q4_k_m.gguf --tasks niah_single,niah_multikey \
       --lengths 4096 --samples 20 --methods deltakv --config "docs/quality/deltakv_gemma3_$c.json" \
       --max-num-seqs 64 --enforce-eager --no-progress \
       --json "$OUT/quality_gemma3_270m_4k_deltakv_$c.json" > "$OUT/quality_deltakv_$c.log" 2>&1
    tail -8 "$OUT/quality_deltakv_$c.log"
  done
}
run_part() {
  case $1 in
    tests)
      nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv
      # CUDA graph captures print warnings at teardown: kept out, so that the tail shows
      # the failures and the count.
      python -m pytest -q -rf tests/gpu tests/kernels 2>&1 | grep -v "CUDAGraph.cpp" | tail -25 ;;
    multiturn)
      # Issue 6: 8 conversations x 10 turns x 4K-token tool outputs, dummy Llama-3-8B.
      python -m sparsevllm.cli bench multiturn --model-config llama3-8b --conversations 8 \
         --turns 10 --tool-tokens 4096 --question-tokens 32 --output-len 64 \
         --max-model-len 43008 --decode-keep-tokens 2048 --max-num-seqs 8 \
         --variants vanilla:nocache vanilla:radix snapkv:chain \
         --json "$OUT/multiturn_h200_llama3_8b.json" --plot "$OUT/multiturn_h200_llama3_8b.png" \
         | tail -4 ;;
    gguf-part)
      # The Gemma-3-270M GGUF (253 MB) travels in 6 parts, one per call (64 MiB limit):
      # split -n 6 -d gemma-3-270m-q4_k_m.gguf .gguf_parts/part; carry .gguf_parts/partNN,
      # and .whl once: gguf 0.19 and transformers 5.24 (5.17's GGUF converter garbles
      # Gemma 3's tokenizer: models/gguf_loader.py refuses it).
      mkdir -p /tmp/g && cp .gguf_parts/part* /tmp/g/ && ls -la /tmp/g
      for w in .whl .whl2; do  # .whl2: llguidance (the engine imports it)
        if ls $w/*.whl >/dev/null 2>&1; then
          python3 -m pip install -q --no-index --no-deps --target /tmp/site $w/*.whl
        fi
      done ;;
    quality)
      quality_grid ;;
    quality-modes)
      quality_modes ;;
    quality-formats)
      quality_formats ;;
    quality-prefill)
      quality_prefill ;;
    tp)
      # Issue 21 item 2 (needs 2 GPUs; not yet run): Llama-3-8B shapes, dense and SnapKV
      # (2,048) at TP=1 and TP=2: decode tok/s and the per-GPU roofline from the JSON (the
      # all-reduce share of a step needs a profile, not part of this run).
      for m in vanilla snapkv; do
        for tp in 1 2; do
          timeout ${TP_RUN_S:-240} $M --prompt-len 8192 --output-len 64 --batch-size ${TP_BATCH:-16} \
             --max-model-len 8448 --sparse-method $m --decode-keep-tokens 2048 \
             --tensor-parallel-size $tp --json "$OUT/tp${tp}_llama3_8b_${m}_8k.json" \
             > "$OUT/tp${tp}_$m.log" 2>&1 || { echo "failed: $m tp $tp"; tail -5 "$OUT/tp${tp}_$m.log"; }
          grep -hE '"(decode_tokens_per_s|time_per_output_token_s|roofline_fraction)"' \
             "$OUT/tp${tp}_llama3_8b_${m}_8k.json"
        done
      done
      # Llama-3-70B shapes (141 GB of weights: only TP=2 holds them), vanilla and SnapKV
      # at 8K and 32K.
      for len in 8192 32768; do
        for m in vanilla snapkv; do
          timeout ${TP_RUN_S:-240} python -m sparsevllm.cli bench throughput --model-config llama3-70b \
             --prompt-len $len --output-len 64 --batch-size ${TP70_BATCH:-8} \
             --max-model-len $((len + 256)) --sparse-method $m --decode-keep-tokens 2048 \
             --tensor-parallel-size 2 --json "$OUT/tp2_llama3_70b_${m}_$len.json" \
             > "$OUT/tp2_70b_${m}_$len.log" 2>&1 || { echo "failed: 70b $m $len"; tail -5 "$OUT/tp2_70b_${m}_$len.log"; }
        done
      done ;;
    deltakv-quality)
      quality_deltakv ;;
    quality-rerun)
      # Issue 7: re-measure some methods' rows (RERUN, default omnikv: its default full
      # layers changed in session 4): drop their records, resume the same grid (the rest
      # is kept).
      python - <<'PY'
import json, os
src = "docs/quality/quality_gemma3_270m_4k.jsonl"
dst = os.environ["OUT"] + "/quality_gemma3_270m_4k.jsonl"
drop = os.environ.get("RERUN", "omnikv").split(",")
keep = [l for l in open(src) if json.loads(l)["method"] not in drop]
open(dst, "w").writelines(keep)
print(f"kept {len(keep)} records")
PY
      quality_grid ;;
    kvpress)
      # Issue 4: snapkv vs kvpress's SnapKVPress at 32K (carry .kvpress_whl: kvpress 0.5.5,
      # transformers 5.2.0, tokenizers 0.22.2; kvpress needs transformers < 5.3).
      python3 -m pip install -q --no-index --no-deps --target /tmp/kvsite .kvpress_whl/*.whl
      $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --batch-size 8 \
         --sparse-method snapkv --decode-keep-tokens 2048 --compare kvpress \
         --kvpress-site /tmp/kvsite --json "$OUT/snapkv_32k_b8_vs_kvpress.json" | tail -3 ;;
    sweep)
      # Issue 4: decode throughput vs context (4K-128K), batch 1, dense vs sparse; one
      # engine per method measures every length.
      mkdir -p /tmp/sweep
      for m in vanilla snapkv streamingllm quest omnikv; do
        extra=""  # every method keeps / reads 2,048 tokens
        [ "$m" = streamingllm ] && extra="--recent-keep-tokens 2044"
        $M --sweep-prompt-lens 4096,16384,32768,65536,130048 --output-len 32 --batch-size 1 \
           --max-model-len 131072 --sparse-method $m --decode-keep-tokens 2048 $extra \
           --json /tmp/sweep/$m.json | tail -5 || echo "failed: $m"
      done
      mkdir -p "$OUT/sweep" && for f in /tmp/sweep/*.json; do cp "$f" "$OUT/sweep/sweep_$(basename "$f")"; done
      python -m sparsevllm.bench.sweep /tmp/sweep/*.json --json "$OUT/sweep_b1.json" \
         --plot "$OUT/sweep_b1.png" --title "Llama-3-8B shapes, H200, batch 1" ;;
    b24)
      # Issue 4: Quest / OmniKV vs vanilla at the same batch (24 x 32K).
      for m in vanilla quest omnikv; do
        $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --batch-size 24 \
           --sparse-method $m --decode-keep-tokens 2048 --json "$OUT/${m}_32k_b24.json" \
           | grep -E '"(decode_tokens_per_s|time_per_output_token_s|roofline_step_s)"'
      done ;;
    overlap)
      # Issue 4: SnapKV's host time per step at batch 128, overlapped scheduling off / on.
      for a in sync async; do
        python -m sparsevllm.bench.profile_step --prompt-len 4096 --batch-size 128 --steps 6 \
           --sparse-method snapkv --decode-keep-tokens 2048 --cprofile 4 \
           $([ $a = sync ] && echo --no-async-scheduling || echo --async-scheduling) \
           --json "$OUT/profile_snapkv_b128_$a.json" | tail -2
      done ;;
    layout)
      # Issue 4: dense decode at 64 x 8K: the KV slot layout (sequential, the default, vs
      # shuffled slots), without and with overlapped scheduling (the CUDA default).
      for o in sequential shuffled; do
        for a in no-async async; do
          $M --prompt-len 8192 --output-len 64 --batch-size 64 --max-model-len 8448 \
             --kv-slot-order $o --$a-scheduling --json "$OUT/dense_b64_8k_slots_${o}_$a.json" \
             | grep -E '"(decode_tokens_per_s|time_per_output_token_s|roofline_step_s)"'
        done
      done ;;
    prefill32k)
      # Issue 4: a 32K prompt's prefill against HF (SDPA attention + the same matmuls).
      for c in 2048 32768; do
        $M --prompt-len 32768 --output-len 16 --batch-size 1 --max-model-len 32896 \
           --chunk-prefill-size $c --max-num-batched-tokens $((c > 8192 ? c : 8192)) \
           --compare hf --json "$OUT/prefill_32k_chunk${c}_vs_hf.json" \
           | grep -E '"prefill_tokens_per_s"|prefill_ratio_vs_hf'
      done ;;
    profile)
      # Where decode steps spend their time (kernel table + wall time, graphs vs eager).
      python -m sparsevllm.bench.profile_step --prompt-len 16384 --batch-size 24 --steps 6 \
         --sparse-method quest --decode-keep-tokens 2048 --json "$OUT/profile_quest.json" | tail -4
      python -m sparsevllm.bench.profile_step --prompt-len 4096 --batch-size 128 --steps 6 \
         --sparse-method snapkv --decode-keep-tokens 2048 --json "$OUT/profile_snapkv.json" | tail -4
      # Quest at batch 1 (sweep: ~4 ms per step at any context): the page table's width
      # (max_model_len / page size) against the same context with a narrow table.
      for len in 34816 131072; do
        python -m sparsevllm.bench.profile_step --prompt-len 32768 --batch-size 1 --steps 6 \
           --max-model-len $len --sparse-method quest --decode-keep-tokens 2048 \
           --json "$OUT/profile_quest_b1_mml$len.json" | tail -2
      done
      # SnapKV's prefill ran at 2/3 of vanilla's speed at 32K: where does it go?
      for m in vanilla snapkv; do
        python -m sparsevllm.bench.profile_step --prompt-len 32768 --batch-size 4 --steps 4 \
           --sparse-method $m --decode-keep-tokens 2048 --prefill-steps 8 --rows 12 \
           --json "$OUT/profile_prefill_$m.json" | grep -A14 "prefill host"
      done ;;
    formats-kernels)
      # Issue 15: the decode kernel on each KV storage format (64 x 8K, byte floor).
      for f in auto int8 fp8_e4m3; do
        python -m sparsevllm.bench.kernels --kv-cache-dtype $f --json "$OUT/kernels_$f.json" \
           | grep -iE "floor|decode|prefill" | head -12
      done ;;
    capacity-methods)
      # Issue 18 item 3: every second-wave method's decode at 32K at its largest batch
      # (decode-capacity mode: one prompt prefilled, its state copied), beside vanilla.
      # METHODS / GPU_UTIL choose a subset and --gpu-memory-utilization.
      for m in ${METHODS:-vanilla kvzip expected_attention keydiff lagkv adakv duoattention rkv strided}; do
        $M --prompt-len 32768 --output-len 32 --max-model-len 32896 --max-batch \
           ${GPU_UTIL:+--gpu-memory-utilization $GPU_UTIL} \
           --decode-capacity --max-num-seqs 512 --sparse-method $m --decode-keep-tokens 2048 \
           --json "$OUT/capacity_32k_$m.json" > "$OUT/capacity_32k_$m.log" 2>&1 ||
          echo "failed: $m"
        grep -E '"(batch_size|decode_tokens_per_s|time_per_output_token_s)"' "$OUT/capacity_32k_$m.json"
      done ;;
    formats-capacity)
      # Issue 15 item 4: SnapKV (2,048) in bf16 and int4, largest batch and batch 256.
      for f in auto int4; do
        $M --prompt-len 32768 --output-len 32 --max-model-len 32896 --max-batch \
           --decode-capacity --max-num-seqs 1024 --sparse-method snapkv --decode-keep-tokens 2048 \
           --kv-cache-dtype $f --json "$OUT/formats_32k_snapkv_${f}_max_cap.json" | tail -3
        $M --prompt-len 32768 --output-len 32 --max-model-len 32896 --batch-size 256 \
           --decode-capacity --max-num-seqs 256 --sparse-method snapkv --decode-keep-tokens 2048 \
           --kv-cache-dtype $f --json "$OUT/formats_32k_snapkv_${f}_b256_cap.json" | tail -3
      done ;;
    kivi-graphs)
      # Issue 15 item 4: KIVI decode steps captured in CUDA graphs (the store without host
      # syncs). The KIVI tests, then SnapKV (2,048) at batch 200 and vanilla at its largest
      # batch (max_num_seqs 64), int4 beside bf16 in the same call. KG_TESTS=0 skips the
      # tests, KG_RUNS picks runs (snapkv_int4 snapkv_auto vanilla_int4 vanilla_auto).
      ls .whl2/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl2/*.whl
      [ "${KG_TESTS:-1}" = 1 ] && python -m pytest -q tests/gpu/test_kivi_cuda.py tests/kernels/test_kivi_decode.py \
         tests/gpu/test_kv_formats_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_overlap_cuda.py \
         tests/gpu/test_mixed_methods_cuda.py 2>&1 | tail -8
      S="--sparse-method snapkv --decode-keep-tokens 2048"
      for r in ${KG_RUNS:-snapkv_int4 snapkv_auto vanilla_int4 vanilla_auto}; do
        f=${r#*_}
        case $r in
          snapkv_*) args="--batch-size 200 --max-num-seqs 200 $S" ;;
          vanilla_*) args="--max-batch --max-num-seqs 64" ;;
        esac
        timeout ${KG_RUN_S:-200} $M --prompt-len 32768 --output-len 32 --max-model-len 32896 \
           --decode-capacity $args --kv-cache-dtype $f --json "$OUT/graphs_$r.json" > "$OUT/graphs_$r.log" 2>&1 ||
          { echo "failed: $r"; tail -3 "$OUT/graphs_$r.log"; }
        grep -hE '"(batch_size|decode_tokens_per_s|time_per_output_token_s|roofline_step_s)"' "$OUT/graphs_$r.json"
      done ;;
    million)
      # Issue 22 item 3: a 1M-token prompt under SnapKV with bounded prefill (KV at most
      # budget + chunk per layer during the prefill); TTFT and peak KV in the JSON.
      python -m sparsevllm.cli bench throughput --model-config llama3-8b-1m \
         --prompt-len 1048000 --output-len 16 --batch-size 1 --max-num-seqs 1 \
         --max-model-len 1048576 --sparse-method snapkv --decode-keep-tokens 2048 \
         --bounded-prefill on --chunk-prefill-size 8192 --max-num-batched-tokens 8192 \
         --json "$OUT/snapkv_1m_bounded.json" \
         | grep -E '"(time_to_first_token_s|peak_kv_slots|peak_kv_bytes|prefill_tokens_per_s|decode_tokens_per_s|mean|max)"' ;;
    formats-throughput)
      # Issue 15: the engine on each format: dense decode at 64 x 8K, and vanilla's largest
      # batch at 32K (the pool holds ~1.94x the slots in int8).
      for f in auto int8 fp8_e4m3; do
        $M --prompt-len 8192 --output-len 64 --batch-size 64 --max-model-len 8448 \
           --kv-cache-dtype $f --json "$OUT/dense_b64_8k_$f.json" \
           | grep -E '"(decode_tokens_per_s|time_per_output_token_s|roofline_step_s|kv_bytes_per_slot)"'
      done
      for f in auto int8; do
        $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --max-batch \
           --kv-cache-dtype $f --json "$OUT/vanilla_32k_maxbatch_$f.json" \
           | grep -E '"(batch_size|decode_tokens_per_s|time_per_output_token_s|roofline_step_s)"'
      done ;;
    deltakv-throughput)
      # Issue 16 item 4: dummy Llama-3-8B with a random compressor of real dims (latent
      # 512 = kv_dim / 4, stride 10, 4 references): decode at 32K and 128K, batch 1 and
      # DeltaKV's largest batch at 32K, beside vanilla and SnapKV (2,048); a profile of
      # DeltaKV's 32K decode steps. DK_LENS / DK_METHODS (batch 1) and DK_MAX_LENS /
      # DK_MAX_METHODS (largest batch) choose a subset; DK_OUT the batch-1 runs' output
      # tokens (default 16); DK_MAX_OUT / DK_MAX_RUN_S the largest-batch runs' output
      # tokens and time limit, DK_MAX_SEQS their max_num_seqs; DK_KNOBS more DeltaKV
      # flags (the defaults: the rebuild kernel, decode steps in CUDA graphs).
      python scripts/deltakv_random_compressor.py --model-config llama3-8b --out /tmp/dk8b.safetensors
      DK="--deltakv-checkpoint /tmp/dk8b.safetensors"
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9]*" | head -1 | tr H h)
      for n in ${DK_LENS-32768 131072}; do
        for m in ${DK_METHODS-vanilla snapkv deltakv}; do
          knobs=""; [ $m = snapkv ] && knobs="--decode-keep-tokens 2048"; [ $m = deltakv ] && knobs="$DK ${DK_KNOBS:-}"
          # 128K: the prompt leaves room for the output inside max_position_embeddings.
          pl=$n; [ $n -gt 65536 ] && pl=$((n - 128))
          timeout ${DK_RUN_S:-240} $M --prompt-len $pl --output-len ${DK_OUT:-16} --max-model-len $((pl + 128)) \
             --batch-size 1 --max-num-seqs 1 --sparse-method $m $knobs \
             --json "$OUT/deltakv_${gpu:-gpu}_${m}_$((n / 1024))k_b1.json" > "$OUT/deltakv_${m}_${n}_b1.log" 2>&1 ||
            echo "failed: $m $n"
          grep -hE '"(decode_tokens_per_s|time_per_output_token_s|kv_bytes_per_slot|peak_kv_bytes)"' \
             "$OUT/deltakv_${gpu:-gpu}_${m}_$((n / 1024))k_b1.json"
        done
      done
      # Largest batch (decode-capacity mode) of each of DK_MAX_METHODS at each of DK_MAX_LENS.
      for n in ${DK_MAX_LENS-32768}; do
        pl=$n; [ $n -gt 65536 ] && pl=$((n - 128))
        for m in ${DK_MAX_METHODS-deltakv}; do
          knobs=""; [ $m = snapkv ] && knobs="--decode-keep-tokens 2048"; [ $m = deltakv ] && knobs="$DK ${DK_KNOBS:-}"
          f="$OUT/deltakv_${gpu:-gpu}_${m}_$((n / 1024))k_max_cap.json"
          timeout ${DK_MAX_RUN_S:-${DK_RUN_S:-240}} $M --prompt-len $pl --output-len ${DK_MAX_OUT:-16} \
             --max-model-len $((pl + 128)) --max-batch --decode-capacity --max-num-seqs ${DK_MAX_SEQS:-1024} \
             --sparse-method $m $knobs --json "$f" > "$OUT/deltakv_${n}_max_$m.log" 2>&1 ||
            { echo "failed: $m max $n"; tail -3 "$OUT/deltakv_${n}_max_$m.log"; }
          grep -hE '"(batch_size|decode_tokens_per_s|time_per_output_token_s|kv_bytes_per_slot)"' "$f"
        done
      done
      # Where a 32K decode step goes (kernel table): the reconstruction GEMM and epilogue.
      echo '{"deltakv_checkpoint": "/tmp/dk8b.safetensors"}' > /tmp/dk8b.json
      [ "${DK_PROFILE:-1}" = 1 ] && timeout ${DK_RUN_S:-240} python -m sparsevllm.bench.profile_step \
         --model-config llama3-8b --prompt-len 32768 --batch-size 1 --steps 4 --rows 15 \
         --sparse-method deltakv --config /tmp/dk8b.json --json "$OUT/profile_deltakv_${gpu:-gpu}_32k_b1.json" \
         | tail -24 ;;
    deltakv-kernels)
      # Issue 16: DeltaKV's decode kernels side by side (session 34): their GPU tests, the
      # rebuild sweep (the fused kernel's defaults timed beside it), then decode at 32K and
      # 128K, batch 1, for rebuild and fused with CUDA graphs and rebuild eager.
      python -m pytest -q -p no:warnings tests/kernels/test_deltakv_decode.py \
         tests/kernels/test_triton_deltakv_engine.py tests/gpu/test_deltakv_cuda.py 2>&1 | tail -3
      timeout ${DK_SWEEP_S:-150} python scripts/deltakv_decode_sweep.py --kernel rebuild \
         --budget $(( ${DK_SWEEP_S:-150} - 50 )) --iters 10 | tail -24
      python scripts/deltakv_random_compressor.py --model-config llama3-8b --out /tmp/dk8b.safetensors
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9]*" | head -1 | tr H h)
      for n in ${DK_LENS-32768 131072}; do
        pl=$n; [ $n -gt 65536 ] && pl=$((n - 128))
        for run in "rebuild" "fused" "rebuild --enforce-eager"; do
          tag=$(echo "$run" | tr -d ' -' | sed 's/enforceeager/_eager/')
          f="$OUT/deltakv_${gpu:-gpu}_$((n / 1024))k_b1_$tag.json"
          timeout ${DK_RUN_S:-150} $M --prompt-len $pl --output-len ${DK_OUT:-32} --max-model-len $((pl + 128)) \
             --batch-size 1 --max-num-seqs 1 --sparse-method deltakv --deltakv-checkpoint /tmp/dk8b.safetensors \
             --deltakv-decode-kernel $run --json "$f" > "$OUT/deltakv_${n}_$tag.log" 2>&1 || echo "failed: $n $run"
          echo "$n $run"; grep -hE '"(decode_tokens_per_s|time_per_output_token_s|cuda_graphs)"' "$f"
        done
      done ;;
    deltakv-fused)
      # Issue 16: the fused DeltaKV decode kernel (deltakv_fused_decode) against the
      # materialising path: its tests, the tile sweep at Llama-3-8B shapes, then DeltaKV
      # at 32K, batch 1, with and without the kernel in the same call.
      python -m pytest -q -p no:warnings tests/kernels/test_deltakv_decode.py tests/kernels/test_deltakv_search.py \
         tests/kernels/test_triton_deltakv_engine.py tests/gpu/test_deltakv_cuda.py 2>&1 | tail -3
      [ "${DK_SWEEP_S:-240}" -gt 0 ] && timeout ${DK_SWEEP_S:-240} python scripts/deltakv_decode_sweep.py --budget $(( ${DK_SWEEP_S:-240} - 40 )) | tail -40
      python scripts/deltakv_random_compressor.py --model-config llama3-8b --out /tmp/dk8b.safetensors
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o "H[0-9]*" | head -1 | tr H h)
      for fused in no-deltakv-fused-decode deltakv-fused-decode; do
        timeout ${DK_RUN_S:-240} $M --prompt-len 32768 --output-len 16 --max-model-len 32896 \
           --batch-size 1 --max-num-seqs 1 --sparse-method deltakv \
           --deltakv-checkpoint /tmp/dk8b.safetensors --$fused \
           --json "$OUT/deltakv_${gpu:-gpu}_32k_b1_$fused.json" > "$OUT/deltakv_$fused.log" 2>&1 ||
          { echo "failed: $fused"; tail -3 "$OUT/deltakv_$fused.log"; }
        grep -hE '"(decode_tokens_per_s|time_per_output_token_s)"' "$OUT/deltakv_${gpu:-gpu}_32k_b1_$fused.json"
      done ;;
    mla)
      # Issue 17: the MLA decode kernel on CUDA (tests, accuracy and speed at GLM-4.7-Flash's
      # shapes), then GLM-4.7-Flash at 32K: SnapKV (2,048) at its largest batch beside
      # vanilla at its own (decode-capacity mode). Carry .whl2 (llguidance). MLA_TESTS=0 skips
      # the tests, MLA_CHECK_ARGS / MLA_METHODS / GPU_UTIL choose the rest.
      ls .whl2/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl2/*.whl
      [ "${MLA_TESTS:-1}" = 1 ] && python -m pytest -q tests/kernels/test_decode_mla.py \
         tests/kernels/test_triton_mla_engine.py tests/gpu/test_mla_cuda.py \
         tests/kernels/test_prefill_sparse.py 2>&1 | tail -15
      timeout ${MLA_CHECK_S:-300} python scripts/mla_decode_check.py --out "$OUT/mla_decode_check.json" ${MLA_CHECK_ARGS:---sweep} \
         2>&1 | tail -30
      G="python -m sparsevllm.cli bench throughput --model-config glm-4.7-flash"
      for m in ${MLA_METHODS:-vanilla snapkv}; do
        timeout ${MLA_LIMIT_S:-200} $G --prompt-len 32768 --output-len 32 --max-model-len 32896 --max-batch \
           --decode-capacity --max-num-seqs 1024 --sparse-method $m --decode-keep-tokens 2048 \
           ${GPU_UTIL:+--gpu-memory-utilization $GPU_UTIL} --json "$OUT/glm47_flash_32k_${m}_max.json" > "$OUT/glm47_flash_32k_$m.log" 2>&1 ||
          echo "failed: $m"; tail -5 "$OUT/glm47_flash_32k_$m.log"
        grep -E '"(batch_size|decode_tokens_per_s|time_per_output_token_s|roofline_step_s)"' \
           "$OUT/glm47_flash_32k_${m}_max.json"
      done ;;
    dense)
      # transformers prefills its whole batch at once: 32 x 8K runs out of an 80 GB H100's
      # memory, so it runs 16 sequences there (its rates are per token).
      mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      hfb=""; [ "${mem:-0}" -lt 100000 ] && hfb="--hf-batch-size 16"
      $M --prompt-len 8192 --output-len 128 --batch-size 32 --max-model-len 8448 \
         --compare hf $hfb --json "$OUT/dense_b32_8k_vs_hf.json" | tail -3
      $M --prompt-len 8192 --output-len 128 --batch-size 64 --max-model-len 8448 \
         --json "$OUT/dense_b64_8k.json" | tail -3 ;;
    long)
      # Issue 4: SnapKV at its largest batch vs vanilla at its own, 32K prompts; LONG_FLAGS
      # go to both (e.g. --kv-slot-order shuffled), SNAP_SEQS caps SnapKV's batch.
      $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --max-batch \
         ${LONG_FLAGS:-} --json "$OUT/vanilla_32k_maxbatch.json" | tail -3
      $M --prompt-len 32768 --output-len 64 --max-model-len 32896 --max-batch \
         --sparse-method snapkv --decode-keep-tokens 2048 --max-num-seqs ${SNAP_SEQS:-128} \
         ${LONG_FLAGS:-} --json "$OUT/snapkv_32k_maxbatch.json" | tail -3 ;;
  esac
}
# Each part's output is also kept in $OUT (a call that times out still returns it).
for part in "$@"; do
  run_part "$part" 2>&1 | tee "$OUT/log_$part.txt"
done
