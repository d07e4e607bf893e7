#!/usr/bin/env bash
# The device calls of one session on a 4-GPU host, written down so that the figures in RESULTS can be
# re-run as they were taken. Independent work runs side by side on separate GPUs (A/B pairs always
# on the same GPU, one after the other). From the repository root on the device, .gpu-deps carried:
#   bash benchmarks/gpu_calls_4gpu.sh decode     30B-A3B decode on GPU 0 (with and without the key-split decode
#                                                attention) and 8B on GPU 1, then 32B TP=2 on GPUs 0-1; beside
#                                                them the whole GPU suite on GPUs 2-3
#   bash benchmarks/gpu_calls_4gpu.sh two        on a 2-GPU host (issue 41's H100 rows): 32B TP=2 (NCCL, then the
#                                                symmetric-memory all-reduce), the TP tests, the tower's 8 x 448² case at TP=2
#   bash benchmarks/gpu_calls_4gpu.sh suite      on a 2-GPU host: the whole GPU suite, the kernel tests on GPU 1, the rest on GPU 0
#                                                (one GPU: SUITE_PART=a, then SUITE_PART=b in another call, or ab: both at once; SUITE_PDL=1:
#                                                with llm.pdl on by default, in the device's copy of the tree)
#   bash benchmarks/gpu_calls_4gpu.sh long       the key split at a LONG_PROMPT-token context (16384), 30B-A3B and 8B
#   bash benchmarks/gpu_calls_4gpu.sh tp4        235B-A22B TP=4 decode (every layer where the cards hold it,
#                                                else LAYERS_235B), then the cluster stage
#   bash benchmarks/gpu_calls_4gpu.sh cluster    2 nodes x 2 GPUs against 1 node x 4 (CLUSTER_S, LAYOUTS, APP_ARGS:
#                                                e.g. '{"placement": {"prefer_local_node": true}}')
#   BUDGET=... bash benchmarks/gpu_calls_4gpu.sh goodput   gpu_goodput.sh on 1 and on 4 GPUs
#   bash benchmarks/gpu_calls_4gpu.sh tower      benchmarks/tower_tp.py at TP=2 and 4, then 235B-A22B served at TP=4
#   bash benchmarks/gpu_calls_4gpu.sh cold       cold starts at 0.5 and 0.9 of goodput, an LLM replica added under load
#   bash benchmarks/gpu_calls_4gpu.sh replicas   goodput with 1 LLM replica per GPU, then with 2 (the default)
#   bash benchmarks/gpu_calls_4gpu.sh stream     goodput with the fused tower on the engine's stream, then its own
#   BUDGET_EACH=270 bash benchmarks/gpu_calls_4gpu.sh ab   the default, one LLM replica per GPU, the tower's own stream (two fit
#                                                a call at 270 s each; 2026-11-27's 170 s cut every search short)
#   bash benchmarks/gpu_calls_4gpu.sh mix        the realistic mix's goodput beside 448² images (MIX_STAGES one or all)
# Everything lands in $OUT/all.tgz (the call's files) and $OUT/summary.txt.
# (2026-11-27's call 1 also ran each decode with --skinny, an option since removed: it lost to cuBLAS.)
# (2026-11-27's second H100 call also ran the 30B-A3B decodes with --unfused-router; the fused router was removed after it.)
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
    # the key split on dense models too: 8B, and 2B (the serving preset: a split that does not pay at short
    # contexts costs its merge kernel in every layer of every small decode step)
    ( dec dense8b_cublas 200 1 --preset qwen3-vl-8b; dec dense8b_no_kv_split 200 1 --preset qwen3-vl-8b --no-kv-split
      dec dense2b 200 1 --preset qwen3-vl-2b; dec dense2b_no_kv_split 200 1 --preset qwen3-vl-2b --no-kv-split ) &
    p8=$!
    # A/B on one GPU, one after the other: today's path (decode attention split over the keys), then the
    # split undone
    dec moe30b_cublas 200 0 --preset qwen3-vl-30b-a3b --profile 1
    dec moe30b_no_kv_split 200 0 --preset qwen3-vl-30b-a3b --no-kv-split
    dec moe30b_profile64 200 0 --preset qwen3-vl-30b-a3b --profile 64  # where 64 streams' steps go (H100: 13% short)
    wait $p8
    dec dense32b_tp2 200 0,1 --preset qwen3-vl-32b --tp 2
    dec dense32b_tp2_symm 200 0,1 --preset qwen3-vl-32b --tp 2 --symm-all-reduce
    wait ;;
  suite)  # the whole GPU suite in one call on a 2-GPU host (one process cut it at 570 s, 2026-11-27): the
          # one-GPU test files on GPUs 0 and 1 side by side, then the two-GPU tests. On a 1-GPU host the
          # two halves do not fit one call: SUITE_PART=a (every file but test_llm_kernels.py) in one call,
          # SUITE_PART=b (test_llm_kernels.py) in the next; the two-GPU tests skip
    two_gpu="tests/test_tensor_parallel.py tests/test_tower_tp.py"
    if [ -n "${SUITE_PDL:-}" ]; then  # the suite as it would run with llm.pdl on by default (this copy of the tree only)
      sed -i 's/    pdl: bool = Field(False,/    pdl: bool = Field(True,/' app/config.py
      python3 -c "from app.config import LLMConfig, AppConfig; assert LLMConfig().pdl and AppConfig().llm.pdl" \
        || { say "SUITE_PDL: could not turn llm.pdl on"; exit 1; }
      say "SUITE_PDL: llm.pdl on by default for this run"
    fi
    files=$(python3 -m pytest --collect-only -q -m gpu tests/ -p no:cacheprovider 2>/dev/null | grep '::' \
      | cut -d: -f1 | sort -u | grep -v -e test_tensor_parallel.py -e test_tower_tp.py)
    if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
      # SUITE_PART=ab: both halves at once on the one GPU, two pytest processes (part b is mostly Triton
      # compiles on the host's cores, part a mostly GPU work: 260 s and 319 s one after the other, 2026-12-02)
      parts=${SUITE_PART:-a}; [ "$parts" = ab ] && parts="a b"
      for p in $parts; do
        ( part=$(echo "$files" | if [ "$p" = b ]; then grep test_llm_kernels.py; else grep -v test_llm_kernels.py; fi)
          timeout "${SUITE_S:-540}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider --durations=10 $part \
            > "$W/gpu_suite_1gpu_$p.log" 2>&1
          say "gpu suite, one GPU, part $p: rc=$? $(tail -1 "$W/gpu_suite_1gpu_$p.log")" ) &
      done
      wait
      tar -C "$W" -czf "$OUT/all.tgz" . ; cp "$W/summary.txt" "$OUT/"; exit 0
    fi
    # test_llm_kernels.py compiles Triton kernels for many shapes on a fresh machine (past 244 s of one
    # test on an H100): it gets GPU 1 to itself, every other file GPU 0 (2026-11-28: dealt alternately,
    # GPU 0's half ran past 420 s)
    for g in 0 1; do
      ( part=$(echo "$files" | if [ $g = 1 ]; then grep test_llm_kernels.py; else grep -v test_llm_kernels.py; fi)
        CUDA_VISIBLE_DEVICES=$g timeout "${SUITE_S:-460}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
          --durations=10 $part > "$W/gpu_suite_$g.log" 2>&1
        say "gpu suite, GPU $g: rc=$? $(tail -1 "$W/gpu_suite_$g.log")" ) &
    done
    wait
    CUDA_VISIBLE_DEVICES=0,1 timeout "${TP_TESTS_S:-120}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      $two_gpu > "$W/gpu_suite_two.log" 2>&1
    say "gpu suite, two GPUs: rc=$? $(tail -1 "$W/gpu_suite_two.log")" ;;
  two)  # (2026-11-27's fifth session also ran the new kernels' one-GPU tests beside 30B-A3B A/Bs on GPU 0 here)
    dec dense32b_tp2 150 0,1 --preset qwen3-vl-32b --tp 2
    dec dense32b_tp2_symm 150 0,1 --preset qwen3-vl-32b --tp 2 --symm-all-reduce  # llm.tp_all_reduce: symm_mem
    CUDA_VISIBLE_DEVICES=0,1 timeout "${TP_TESTS_S:-120}" python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_tensor_parallel.py tests/test_tower_tp.py > "$W/gpu_tests_2.log" 2>&1
    say "gpu tests (two GPUs) rc=$? $(tail -1 "$W/gpu_tests_2.log")"
    # the tower case the fourth session's timeout cut off: many items, where data-parallel may win
    say "start tower_tp2 ${TOWER_CASES:-8x448^2}"
    CUDA_VISIBLE_DEVICES=0,1 timeout "${TOWER_S:-150}" python3 benchmarks/tower_tp.py --preset qwen3-vl-8b --tp 2 \
      --cases "${TOWER_CASES:-8x448^2}" --out "$W/tower_tp2.json" > "$W/tower_tp2.log" 2>&1
    say "end tower_tp2 rc=$?" ;;
  long)  # decode attention split over the keys at long contexts (what it was built for; at a 128-token
         # prompt it changed nothing, 2026-11-27): 30B-A3B on GPU 0 and 8B on GPU 1, each with and without
    P=(--prompt "${LONG_PROMPT:-16384}" --max-model-len $(( ${LONG_PROMPT:-16384} + 512 )) --streams 8)  # 8 x 16.9k fits an H100's 30B KV (191k)
    ( dec dense8b_long 200 1 --preset qwen3-vl-8b "${P[@]}"; dec dense8b_long_no_kv_split 200 1 --preset qwen3-vl-8b "${P[@]}" --no-kv-split ) &
    dec moe30b_long 200 0 --preset qwen3-vl-30b-a3b "${P[@]}"
    dec moe30b_long_no_kv_split 200 0 --preset qwen3-vl-30b-a3b "${P[@]}" --no-kv-split
    wait ;;
  tp4)
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    L=(--layers "${LAYERS_235B:-24}"); [ "$mem" -gt 120000 ] && L=()   # an H200 holds a quarter of 235B
    dec moe235b_tp4 "${TP4_S:-280}" 0,1,2,3 --preset qwen3-vl-235b-a22b "${L[@]}" --tp 4 --gpu-memory-utilization 0.93 \
      --profile 1  # (2026-11-27: without the profile)
    ;&  # (2026-11-27's call 2 went on to the cluster run here; it timed out in its second layout)
  cluster)  # 2 nodes x 2 GPUs against 1 node x 4, each layout written as soon as it is done
    say "start cluster"
    S=${CLUSTER_S:-480}  # (2026-11-27, sixth session: one node took 237 s, two 160 s; 340 left no room for both)
    timeout "$S" python3 benchmarks/cluster_scaling.py --gpus 4 --rate "${RATE:-500}" --deadline-s $(( S - 10 )) \
      --layouts "${LAYOUTS:-1 2}" --app-args "${APP_ARGS:-{\}}" --out-dir "$W/cluster" > "$W/cluster.log" 2>&1
    say "end cluster rc=$? $(grep -E 'done in|two nodes / one' "$W/cluster.log" | tail -12 | tr '\n' ' ')"
    # LOCAL_S > 0: then two nodes again with the Routers' handles preferring their own node (the locality A/B)
    L=${LOCAL_S:-0}
    [ "$L" -gt 60 ] && { say "start cluster, two nodes, prefer_local_node"
      timeout "$L" python3 benchmarks/cluster_scaling.py --gpus 4 --rate "${RATE:-500}" --deadline-s $(( L - 10 )) \
        --layouts 2 --app-args '{"placement": {"prefer_local_node": true}}' --out-dir "$W/cluster_local" \
        > "$W/cluster_local.log" 2>&1
      say "end cluster_local rc=$? $(grep -E 'done in|req/s' "$W/cluster_local.log" | tail -6 | tr '\n' ' ')"; } ;;
  goodput)
    OUT=$W BUDGET=${BUDGET:-540} STAGES=${STAGES:-"one all"} bash benchmarks/gpu_goodput.sh > "$W/goodput.log" 2>&1
    say "goodput rc=$?"; tail -60 "$W/summary.md" ;;
  tower)  # the tower in a TP group, three ways (8B-shaped tower = 235B-A22B's), then 235B-A22B served at TP=4
    for n in 2 4; do
      say "start tower_tp$n"
      # TOWER_CASES, e.g. "8x448^2" (2026-11-27's 90 s ended before that case); each case is written when done
      timeout "${TOWER_S:-150}" python3 benchmarks/tower_tp.py --preset qwen3-vl-8b --tp $n --out "$W/tower_tp$n.json" \
        ${TOWER_CASES:+--cases $TOWER_CASES} > "$W/tower_tp$n.log" 2>&1
      say "end tower_tp$n rc=$?"
    done
    OUT=$W SERVE_N=${SERVE_N:-512} STAGES=serve_moe235b_tp4 timeout "${SERVE235_S:-400}" bash benchmarks/gpu_moe_tp.sh \
      > "$W/serve235.log" 2>&1
    say "serve_moe235b_tp4 rc=$? $(grep -E 'req/s|error' "$W/serve235.log" | tail -3 | tr '\n' ' ')" ;;
  replicas|stream|ab)  # Poisson goodput on one GPU, one variant after the other (BUDGET_EACH s each):
    # replicas: one LLM replica per GPU against two (the default; two time-slice the GPU);
    # stream: the fused tower on a stream of its own against the engine's (the default, `shared`): the
    # tower's part of TTFT is the first to grow above goodput (2026-11-27, fourth session)
    if [ "$1" = replicas ]; then
      names=(r1 r2); args=('{"placement": {"llm_replicas_per_gpu": 1}}' '{"placement": {"llm_replicas_per_gpu": 2}}')
    elif [ "$1" = ab ]; then  # the default, then each change alone (AB_VARIANTS: a subset, e.g. "0 2")
      all_names=(r2_shared r1_shared r2_own)
      all_args=('{}' '{"placement": {"llm_replicas_per_gpu": 1}}' '{"encoder": {"stream": "own"}}')
      names=(); args=()
      for i in ${AB_VARIANTS:-0 1 2}; do names+=("${all_names[$i]}"); args+=("${all_args[$i]}"); done
    else
      names=(shared own); args=('{"encoder": {"stream": "shared"}}' '{"encoder": {"stream": "own"}}')
    fi
    for i in "${!names[@]}"; do
      mkdir -p "$W/${names[$i]}"
      OUT=$W/${names[$i]} BUDGET=${BUDGET_EACH:-270} STAGES=one bash benchmarks/gpu_goodput.sh \
        configs/qwen3-vl-2b-gpu.yaml --app-args "${args[$i]}" > "$W/${names[$i]}/goodput.log" 2>&1
      say "${names[$i]} ${args[$i]} rc=$? $(grep -F 'goodput**' "$W/${names[$i]}/summary.md" | head -1)"
    done ;;
  mix)  # the realistic mix's goodput (goodput.py --workload mix; its TTFT bound --ttft-p99-ms-mix) beside 448²
         # images, on one GPU (STAGES=one) or every GPU (MIX_STAGES=all, RAMP=4 as gpu_goodput.sh advises)
    OUT=$W BUDGET=${BUDGET:-560} STAGES=${MIX_STAGES:-one} WORKLOADS="image mix" bash benchmarks/gpu_goodput.sh \
      configs/qwen3-vl-2b-gpu.yaml > "$W/goodput.log" 2>&1
    say "mix rc=$?"; tail -30 "$W/summary.md" ;;
  cold)  # one GPU: the first deploy a cold start at COLD_FIRST req/s (90: half of 2026-11-27's 180.48 goodput;
         # that night's 73 was 0.40 of it), 0.9 x goodput from ready, then a
         # replica added by autoscaling under load (1 LLM replica, then 2 on the GPU)
    OUT=$W BUDGET=${BUDGET:-560} STAGES=one COLD_FIRST=${COLD_FIRST:-90} bash benchmarks/gpu_goodput.sh \
      configs/qwen3-vl-2b-gpu.yaml --scale-up 0.5 > "$W/goodput.log" 2>&1
    say "cold rc=$?"; tail -30 "$W/summary.md" ;;
esac
say "done"
ray stop --force > /dev/null 2>&1
tar czf "$OUT/all.tgz" -C "$W" . && cp "$W/summary.txt" "$OUT/"
cat "$W/summary.txt"
