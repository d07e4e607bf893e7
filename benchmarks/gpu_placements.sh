#!/usr/bin/env bash
# One device call that serves the same workload under several placements, one after the other on the
# same machine (a side-by-side comparison), each followed by its per-stage trace. From the repository
# root with .gpu-deps carried; results under $OUT/<placement>/:
#   PLACEMENTS="fused colocate" bash benchmarks/gpu_placements.sh CONFIG [serve.py args ...]
# e.g. PLACEMENTS="fused colocate" bash benchmarks/gpu_placements.sh configs/qwen3-vl-2b-gpu.yaml \
#        --sweep --workload image --num-requests 48 --rounds 3
# A placement may name its LLM replica count: "fused:2" is `--placement fused --llm-replicas 2`. Ray
# starts as `make serve` starts it (deployments/ray_env.py: RAY_SERVE_THROUGHPUT_OPTIMIZED=1); a
# trailing "+plain" runs that placement with Ray's defaults (RAY_SERVE_THROUGHPUT_OPTIMIZED=0, and Ray's
# 100 KB inline limit for call arguments instead of ray_env.py's 512 KB).
# GPU_TESTS="tests/test_fused.py" runs those tests with `-m gpu` first. Each placement's outputs are
# packed into $OUT/<placement>.tgz (the device tool returns a limited number of files).
set -uo pipefail
source benchmarks/gpu_env.sh
if [ -n "${GPU_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -m gpu $GPU_TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
fi
CONFIG=$1; shift
for placement in ${PLACEMENTS:-fused colocate}; do
  spec=${placement%+plain}; opt=1; [ "$spec" != "$placement" ] && opt=0
  policy=${spec%%:*}
  extra=(); [ "$policy" != "$spec" ] && extra=(--llm-replicas "${spec#*:}")
  dir="$OUT/${spec/:/x}"; [ $opt = 0 ] && dir="${dir}_plain"; mkdir -p "$dir"
  echo "=== $placement"
  inline=524288; [ $opt = 0 ] && inline=102400  # the project's (deployments/ray_env.py), or Ray's
  RAY_SERVE_THROUGHPUT_OPTIMIZED=$opt RAY_max_direct_call_object_size=$inline RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 \
  timeout "${SERVE_TIMEOUT:-300}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" --no-progress \
    --placement "$policy" "${extra[@]}" --out-dir "$dir" "$@" 2>&1 | grep -v "Warning\|warn(" \
    | tee "$dir/serve.txt" | grep "^| \|ready" | tail -12
  python3 benchmarks/serve_trace.py /tmp/ray/session_latest/logs/serve > "$dir/trace.txt" 2>&1
  tail -14 "$dir/trace.txt"
  tar czf "$dir.tgz" -C "$OUT" "$(basename "$dir")" && rm -rf "$dir"
done
