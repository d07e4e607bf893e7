#!/usr/bin/env bash
# One device call for models beyond one GPU (issue: MoE and tensor parallelism): the GPU tests of the
# MoE kernel, the MoE engine and tensor parallelism, the kernel benchmark, then decode speed per shape.
# Run from the repository root on the GPU machine, with .gpu-deps carried:
#   STAGES="tests kernel moe30b" bash benchmarks/gpu_moe_tp.sh          (results under $OUT)
# Stages: tests, tptest (the multi-GPU test alone), kernel, moe30b, dense8b, dense32b_tp, moe30b_tp,
# moe235b_tp4 (every layer on H200s, else LAYERS_235B layers; run 2026-11-27 on 4 x H200); served over HTTP:
# serve_8b, serve_moe30b, serve_moe30b_tp2 (run 2026-11-27), serve_moe235b_tp4 (not yet). The matrix-vector
# projections (app/llm/gemv.py): gemv_tests, gemv_ab (30B-A3B with a profile, and 8B, each with the kernel where
# the start-up timing keeps it and with cuBLAS throughout), sweep64 (the sorted MoE path's tiles at 64 tokens).
# Programmatic dependent launch (app/llm/pdl.py): pdl_ab (its GPU tests, then 30B-A3B and 8B with and without);
# pdl_split (30B-A3B with PDL, the split-K tiles off and on, A B A B); direct_sweep (the 1-2 token MoE kernels swept
# one at a time, BW: the card's TB/s for the floor); profile_nopdl (30B-A3B's kernels without PDL, each its own time);
# tiles_ab (the few-token MoE path's tiles against the earlier ones, A B twice); prefetch_ab (the matrix-vector
# kernel's first weight tile loaded before its PDL wait or after it: the GPU tests of gemv and PDL, then 30B-A3B
# A B A B and 8B A B).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu-deps/activate
export PYTHONUNBUFFERED=1 VLM_SERVE_CACHE=/tmp/vlm-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
STAGES=${STAGES:-"tests kernel moe30b"}
run() { echo "== $1"; shift; "$@" 2>&1 | grep -v Warning | tail -${TAIL:-15}; }
# 235B-A22B: every layer where a quarter of it fits a card (H200: 109.5 GiB of 141), else LAYERS_235B (24) layers
layers_235b() { [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -gt 120000 ] \
                && echo "${LAYERS_235B:-}" || echo "${LAYERS_235B:-24}"; }
for s in $STAGES; do case $s in
  tests) run tests timeout 400 python3 -m pytest -q -rs -m gpu tests/test_fused_moe.py tests/test_llm_moe.py \
           tests/test_tensor_parallel.py tests/test_llm_kernels.py -p no:cacheprovider ;;
  tptest) run tptest timeout 200 python3 -m pytest -q -rs -m gpu tests/test_tensor_parallel.py -p no:cacheprovider ;;
  gemv_tests) run gemv_tests timeout 300 python3 -m pytest -q -rs -m gpu tests/test_gemv.py tests/test_fused_moe.py \
                tests/test_llm_moe.py -p no:cacheprovider ;;
  gemv_ab) run moe30b_gemv timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --no-gemv-split --profile 1 \
             --out "$OUT/moe30b_gemv.json"
           run moe30b_cublas timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --no-gemv \
             --out "$OUT/moe30b_cublas.json"
           run moe30b_gemv_split timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --gemv-split \
             --out "$OUT/moe30b_gemv_split.json"
           run dense8b_gemv timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 --out "$OUT/dense8b_gemv.json"
           run dense8b_cublas timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 --no-gemv \
             --out "$OUT/dense8b_cublas.json" ;;
  pdl_ab) run pdl_tests timeout 240 python3 -m pytest -q -rs -m gpu tests/test_pdl.py -p no:cacheprovider
          run moe30b_pdl timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --pdl --profile 1 \
            --out "$OUT/moe30b_pdl.json"
          run moe30b_nopdl timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --no-pdl --out "$OUT/moe30b_nopdl.json"
          run dense8b_pdl timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 --pdl --out "$OUT/dense8b_pdl.json"
          run dense8b_nopdl timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 --no-pdl --out "$OUT/dense8b_nopdl.json" ;;
  pdl_split) # PDL with and without the split-K matrix-vector tiles, alternated (A B A B), with kernel profiles of 1 and of 64 streams
             run moe30b_pdl_a timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --no-gemv-split --profile 1 \
               --out "$OUT/moe30b_pdl_a.json"
             run moe30b_pdl_split_a timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --gemv-split \
               --out "$OUT/moe30b_pdl_split_a.json"
             run moe30b_pdl_b timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --no-gemv-split --profile 64 \
               --out "$OUT/moe30b_pdl_b.json"
             run moe30b_pdl_split_b timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --gemv-split \
               --out "$OUT/moe30b_pdl_split_b.json" ;;
  direct_sweep) run direct_sweep timeout ${SWEEP_S:-200} python3 benchmarks/moe_kernel.py --tokens 1 2 --direct-sweep --pdl \
                  --bandwidth "${BW:-3.35}" --out "$OUT/moe_kernel_direct.json" ;;
  profile_nopdl) # every kernel's own duration (with PDL a kernel's span includes its wait for the one before)
                 run moe30b_nopdl_profile timeout 120 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 \
                   --no-pdl --profile 1 --out "$OUT/moe30b_nopdl_profile.json" ;;
  tiles_ab) # the few-token MoE path's tiles (moe_config) against those before 2026-12-02
            # (benchmarks/variants/moe_direct_tiles_2026-11-27.json), alternated twice
            for r in a b; do
              run moe30b_tiles_$r timeout 120 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 --out "$OUT/moe30b_tiles_$r.json"
              run moe30b_oldtiles_$r timeout 120 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 \
                --direct-config benchmarks/variants/moe_direct_tiles_2026-11-27.json --out "$OUT/moe30b_oldtiles_$r.json"
            done ;;
  prefetch_ab) run prefetch_tests timeout 200 python3 -m pytest -q -rs -m gpu tests/test_gemv.py tests/test_pdl.py -p no:cacheprovider
               for r in a b; do
                 run moe30b_prefetch_$r timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 \
                   --out "$OUT/moe30b_prefetch_$r.json"
                 run moe30b_noprefetch_$r timeout 150 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --new 128 \
                   --no-weight-prefetch --out "$OUT/moe30b_noprefetch_$r.json"
               done
               run dense8b_prefetch timeout 120 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 --out "$OUT/dense8b_prefetch.json"
               run dense8b_noprefetch timeout 120 python3 benchmarks/decode.py --preset qwen3-vl-8b --new 128 \
                 --no-weight-prefetch --out "$OUT/dense8b_noprefetch.json" ;;
  sweep64) run sweep64 timeout ${SWEEP_S:-200} python3 benchmarks/moe_kernel.py --tokens 64 --sweep --bandwidth 4.8 \
             --out "$OUT/moe_kernel_sweep64.json" ;;
  kernel) run kernel timeout 200 python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel.json" ;;
  moe30b) run moe30b timeout 400 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --out "$OUT/moe30b.json" ;;
  dense8b) run dense8b timeout 300 python3 benchmarks/decode.py --preset qwen3-vl-8b --out "$OUT/dense8b.json" ;;
  dense32b_tp) run dense32b_tp1 timeout 240 python3 benchmarks/decode.py --preset qwen3-vl-32b --max-num-seqs 64 \
                 --gpu-memory-utilization 0.9 --out "$OUT/dense32b_tp1.json"
               run dense32b_tp2 timeout 240 python3 benchmarks/decode.py --preset qwen3-vl-32b --tp 2 --out "$OUT/dense32b_tp2.json" ;;
  moe30b_tp) run moe30b_tp2 timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --tp 2 --moe tp --out "$OUT/moe30b_tp2.json"
             run moe30b_ep2 timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --tp 2 --moe ep --out "$OUT/moe30b_ep2.json" ;;
  serve_8b|serve_moe30b|serve_moe30b_tp2|serve_moe235b_tp4)
      # served end to end from a config-only folder (tower and LLM made on the GPU), 448² images, closed loop
      case $s in serve_8b) P=qwen3-vl-8b; L=""; TP=1 ;; serve_moe30b) P=qwen3-vl-30b-a3b; L=""; TP=1 ;;
                 serve_moe30b_tp2) P=qwen3-vl-30b-a3b; L=""; TP=2 ;; serve_moe235b_tp4) P=qwen3-vl-235b-a22b; L=$(layers_235b); TP=4 ;; esac
      CK=$(python3 -c "from pathlib import Path; from benchmarks.decode import checkpoint_folder; print(checkpoint_folder('$P', ${L:-None}, Path('/tmp/vlm-serve-decode')))")
      run $s timeout 540 python3 benchmarks/serve.py --start --serve-config configs/qwen3-vl-8b-gpu.yaml --model "$CK" \
        --app-args "{\"llm\": {\"load_format\": \"dummy\", \"gpu_memory_utilization\": 0.8}, \"placement\": {\"llm_tensor_parallel\": $TP}}" \
        --num-gpus $TP --concurrency ${SERVE_C:-256} --num-requests ${SERVE_N:-2048} --warmup 64 --out-dir "$OUT/$s" ;;
  moe235b_tp4) L=$(layers_235b); run moe235b_tp4 timeout 500 python3 benchmarks/decode.py --preset qwen3-vl-235b-a22b \
                 ${L:+--layers $L} --tp 4 --gpu-memory-utilization 0.93 --out "$OUT/moe235b_tp4.json" ;;
esac; done
