#!/usr/bin/env bash
# One device call: serve a fixed-concurrency load and sample every serving process with py-spy while
# it runs, to see where each process's CPU goes under load (the host path, issue 12). From the
# repository root with the bundle built by `bash benchmarks/bundle_gpu_deps.sh` carried (.gpu-deps: py-spy
# on its PATH).
# Results in $OUT/profile.tgz: raw stacks per process, all threads and the GIL holder
# (benchmarks/pyspy_sampler.py; summed by benchmarks/pyspy_summary.py):
#   bash benchmarks/gpu_profile_serving.sh CONFIG [serve.py args ...]
# e.g. bash benchmarks/gpu_profile_serving.sh configs/qwen3-vl-2b-gpu.yaml --placement fused --llm-replicas 2 \
#        --workload image --concurrency 128 --num-requests 2000 --warmup 16
# The samples start PROFILE_AFTER_S (default 2) after the timed requests start, for PROFILE_S (default 10).
# Under Poisson load, goodput.py --pyspy py-spy --pyspy-rate R samples inside one point's window instead.
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=$1; shift
dir="$OUT/profile"; mkdir -p "$dir"
PYSPY=$(command -v py-spy) || { echo "py-spy is not on PATH: carry .gpu-deps (benchmarks/bundle_gpu_deps.sh)"; exit 1; }
(
  # serve.py prints "application ready" once every replica answers. It then builds its request bodies
  # and warms up; timed requests carry a tag (workload-c<concurrency>-<seed>-<i>) that the replicas log.
  timeout 240 bash -c "until grep -q 'application ready' '$dir/serve.txt' 2>/dev/null; do sleep 0.5; done" || exit 0
  timeout 120 bash -c "until grep -qE -- '-c[0-9]+-[0-9]+-[0-9]+' /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null; do
    sleep 0.5; done" || exit 0
  python3 benchmarks/pyspy_sampler.py "$PYSPY" "$dir" --delay "${PROFILE_AFTER_S:-2}" --duration "${PROFILE_S:-10}" --gil
) &
timeout "${SERVE_TIMEOUT:-300}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" --no-progress \
  --out-dir "$dir/serve" "$@" 2>&1 | grep --line-buffered -v "Warning\|warn(" | tee "$dir/serve.txt" | grep "^| \|ready" | tail -8
wait
tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$dir"
