#!/usr/bin/env bash
# One device call for serving (issue 12): `serve.py --start` (the app deployed from a config file as
# `serve run` does) with the given arguments, then the per-stage breakdown from the replicas' logs
# (benchmarks/serve_trace.py). Run from the repository root with .gpu-deps carried; results in $OUT:
#   bash benchmarks/gpu_serve.sh CONFIG [serve.py args ...]
# e.g. bash benchmarks/gpu_serve.sh configs/qwen3-vl-2b-gpu.yaml --placement colocate --sweep --workload image
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=$1; shift
timeout "${SERVE_TIMEOUT:-540}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" --no-progress \
  --out-dir "$OUT/serve" "$@" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/serve.txt" | grep -v "^  " | tail -40
python3 benchmarks/serve_trace.py /tmp/ray/session_latest/logs/serve | tee "$OUT/trace.txt"
tar czf "$OUT/serve_logs.tgz" -C /tmp/ray/session_latest/logs serve 2>/dev/null
