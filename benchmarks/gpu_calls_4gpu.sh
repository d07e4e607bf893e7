#!/usr/bin/env bash
# The device calls of one session on a 4-GPU host, written down so that the figures in RESULTS can be
# re-run as they were taken. Independent work runs side by side on separate GPUs (A/B pairs always
# on the same GPU, one after the other). From the repository root on the device, .gpu-deps carried:
#   bash benchmarks/gpu_calls_4gpu.sh decode     30B-A3B decode on GPU 0 and 8B on GPU 1, then 32B
#                                                TP=2 on GPUs 0-1; beside them the whole GPU suite on GPUs 2-3
#   bash benchmarks/gpu_calls_4gpu.sh tp4        235B-A22B TP=4 decode (every layer where the cards hold it,
#                                                else LAYERS_235B), then 2 nodes x 2 GPUs against 1 node x 4
#   BUDGET=... bash benchmarks/gpu_calls_4gpu.sh goodput   gpu_goodput.sh on 1 and on 4 GPUs
# Everything lands in $OUT/all.tgz (the call's files) and $OUT/summary.txt.
# (2026-11-27's call 1 also ran each decode with --skinny, an option since removed: it lost to cuBLAS.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; W=/tmp/calls; rm -rf "$W"; mkdir -p "$W" "$OUT"
source .gpu-deps/activate
export PYTHONUNBUFFERED=1 VLM_SERVE_CACHE=/tmp/vlm-cache RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$W/env.txt"; nproc | tee -a "$W/env.txt"
T0=$(date +%s)
D=(python3 benchmarks/decode.py --new 128)
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$W/summary.txt"; }
dec() {  # NAME TIMEOUT GPUS decode.py args...
  local name=$1 t=$2 gpus=$3; shift 3
  say "start $name on GPUs $gpus"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$t" "${D[@]}" "$@" --out "$W/$name.json" > "$W/$name.log" 2>&1
  say "end $name rc=$? $(grep -o '"single_decode_tok_s": [0-9.]*' "$W/$name.json" 2>/dev/null)"
}
case ${1:-decode} in
  decode)
    ( CUDA_VISIBLE_DEVICES=2,3 timeout "${SUITE_S:-560}" python3 -m pytest -q -rs -m gpu tests/ -p no:cacheprovider \
        --durations=20 > "$W/gpu_suite.log" 2>&1; say "gpu suite rc=$? $(tail -1 "$W/gpu_suite.log")" ) &
    dec dense8b_cublas 200 1 --preset qwen3-vl-8b &
    p8=$!
    dec moe30b_cublas 200 0 --preset qwen3-vl-30b-a3b --profile 1
    wait $p8
    dec dense32b_tp2 200 0,1 --preset qwen3-vl-32b --tp 2
    wait ;;
  tp4)
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    L=(--layers "${LAYERS_235B:-24}"); [ "$mem" -gt 120000 ] && L=()   # an H200 holds a quarter of 235B
    dec moe235b_tp4 "${TP4_S:-280}" 0,1,2,3 --preset qwen3-vl-235b-a22b "${L[@]}" --tp 4 --gpu-memory-utilization 0.93
    say "start cluster"
    timeout "${CLUSTER_S:-280}" python3 benchmarks/cluster_scaling.py --gpus 4 --rate "${RATE:-500}" \
      --out-dir "$W/cluster" > "$W/cluster.log" 2>&1
    say "end cluster rc=$? $(tail -3 "$W/cluster.log" | tr '\n' ' ')" ;;
  goodput)
    OUT=$W BUDGET=${BUDGET:-540} STAGES=${STAGES:-"one all"} bash benchmarks/gpu_goodput.sh > "$W/goodput.log" 2>&1
    say "goodput rc=$?"; tail -60 "$W/summary.md" ;;
esac
say "done"
ray stop --force > /dev/null 2>&1
tar czf "$OUT/all.tgz" -C "$W" . && cp "$W/summary.txt" "$OUT/"
cat "$W/summary.txt"
