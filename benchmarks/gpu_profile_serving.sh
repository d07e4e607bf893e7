#!/usr/bin/env bash
# One device call: serve a fixed-concurrency load and sample every serving process with py-spy while
# it runs, to see where each process's CPU goes under load (the host path, issue 12). From the
# repository root with .gpu-deps and .gpu-tools (py-spy.xz, a static binary from PyPI's py-spy wheel)
# carried; .gpu-tools/py-spy.xz comes from `pip download py-spy --no-deps --only-binary=:all: --platform
# manylinux2014_x86_64 -d /tmp/w`, the wheel's py_spy-*.data/scripts/py-spy compressed with `xz -9`.
# Results in $OUT/profile.tgz (collapsed stacks per process, summed by benchmarks/pyspy_summary.py):
#   bash benchmarks/gpu_profile_serving.sh CONFIG [serve.py args ...]
# e.g. bash benchmarks/gpu_profile_serving.sh configs/qwen3-vl-2b-gpu.yaml --placement fused --llm-replicas 2 \
#        --workload image --concurrency 128 --num-requests 2000 --warmup 16
# The samples start PROFILE_AFTER_S (default 2) after the timed requests start, for PROFILE_S (default 10).
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=$1; shift
dir="$OUT/profile"; mkdir -p "$dir"
PYSPY=/tmp/py-spy
xz -dc .gpu-tools/py-spy.xz > $PYSPY && chmod +x $PYSPY
(
  # serve.py prints "application ready" once every replica answers. It then builds its request bodies
  # and warms up; timed requests carry a tag (workload-c<concurrency>-<seed>-<i>) that the replicas log.
  timeout 240 bash -c "until grep -q 'application ready' '$dir/serve.txt' 2>/dev/null; do sleep 0.5; done" || exit 0
  timeout 120 bash -c "until grep -qE -- '-c[0-9]+-[0-9]+-[0-9]+' /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null; do
    sleep 0.5; done" || exit 0
  sleep "${PROFILE_AFTER_S:-2}"
  ps -eo pid,args | grep -E "ray::(ServeReplica|ProxyActor)" | grep -v grep > "$dir/processes.txt"
  while read -r pid args; do
    name=$(echo "$args" | sed -E 's/^ray::(ServeReplica:[^:]+:)?//; s/[^A-Za-z0-9_.-]+/_/g')
    $PYSPY record --pid "$pid" --rate 100 --duration "${PROFILE_S:-10}" --nonblocking --threads --format raw \
      --output "$dir/$name.$pid.txt" > "$dir/$name.$pid.log" 2>&1 &
  done < "$dir/processes.txt"
  wait
) &
timeout "${SERVE_TIMEOUT:-300}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" --no-progress \
  --out-dir "$dir/serve" "$@" 2>&1 | grep --line-buffered -v "Warning\|warn(" | tee "$dir/serve.txt" | grep "^| \|ready" | tail -8
wait
tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -rf "$dir"
