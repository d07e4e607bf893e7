#!/usr/bin/env bash
# One device call that measures how serving scales from one GPU to all of a host's GPUs, through Ray
# Serve's HTTP proxy and through the Routers' own shared port (app/api/shared_port.py), one run after
# the other on the same machine. From the repository root with .gpu-deps carried:
#   RUNS="proxy:1 proxy:2 port:1 port:2" bash benchmarks/gpu_scaling.sh CONFIG [serve.py args ...]
# e.g. ... configs/qwen3-vl-2b-gpu.yaml --workload image --concurrency 64 256 512 --num-requests 1024 --warmup 32
# A run is PATH:GPUS. Port runs pin the Routers at ROUTERS_PER_GPU per GPU when it is set (otherwise
# they autoscale: app.serving.autoscaling.RouterAutoscalingPolicy counts the port's requests);
# MEDIA_PER_GPU, when set, sets the MediaPreprocessor's min_replicas to that many per GPU and its ceiling
# as the builder does (every run); otherwise the builder's floor (placement.media_replicas_per_gpu) applies.
# ROUTER_SAMPLE, when set, gives the LLM's LeastLoadedRouter that `sample` (replicas drawn per request;
# 0 ranks them all, the routing before 2026-11-26) through the config file's request_router_config.
# TAG is appended to each run's label. Results per run in $OUT/<path>x<gpus><TAG>.tgz (serve.py's JSON
# and report, the config it ran, the per-stage trace).
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=$1; shift
# The config's embedded checkpoint is built once here: on a fresh machine that takes ~40 s, which the
# first run's SERVE_TIMEOUT would otherwise have to cover.
python3 -c "import sys, yaml; from app.checkpoints.model_builder import resolve_model
a = yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']; print('model at', resolve_model(a['model'], a.get('cache_dir')))" "$CONFIG"
for run in ${RUNS:-proxy:1 proxy:2 port:2}; do
  path=${run%%:*}; gpus=${run#*:}
  label="${path}x${gpus}${TAG:-}"; dir="$OUT/$label"; mkdir -p "$dir"
  config="$dir/config.yaml"; extra=(--via proxy); routers=0
  if [ "$path" = port ]; then routers=$(( ${ROUTERS_PER_GPU:-0} * gpus )); extra=(--via port --router-port 8800); fi
  python3 - "$CONFIG" "$config" "$routers" "$(( ${MEDIA_PER_GPU:-0} * gpus ))" "${ROUTER_SAMPLE:-}" "$gpus" <<'EOF'
# Each override starts from the builder's own options for this machine (deployments/app.py), since a
# config file's autoscaling_config or request_router_config replaces the builder's whole value.
import os, sys, yaml
from app.config import AppConfig
from deployments.app import deployment_options
cfg = yaml.safe_load(open(sys.argv[1]))
routers, media, sample, gpus = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
app = cfg["applications"][0]
opts, _ = deployment_options(AppConfig(**app["args"]), gpus, os.cpu_count() or 2)
for d in app["deployments"]:
    scaling = {**opts[d["name"]].get("autoscaling_config", {}), **d.get("autoscaling_config", {})}
    if d["name"] == "Router" and routers:
        d["autoscaling_config"] = scaling | {"min_replicas": routers, "max_replicas": routers}
    if d["name"] == "MediaPreprocessor" and media:  # the builder's ceiling: at least twice the floor
        d["autoscaling_config"] = scaling | {"min_replicas": media,
                                             "max_replicas": max(2 * media, scaling["max_replicas"])}
    if d["name"] == "LLM" and sample:
        router = opts["LLM"]["request_router_config"].model_dump(exclude_unset=True)
        d["request_router_config"] = router | {"request_router_kwargs": {"sample": int(sample)}}
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
EOF
  echo "=== $label"
  ray stop --force >/dev/null 2>&1
  RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 timeout "${SERVE_TIMEOUT:-200}" python3 benchmarks/serve.py --start \
    --serve-config "$config" --num-gpus "$gpus" --no-progress --out-dir "$dir" "${extra[@]}" "$@" 2>&1 \
    | grep -v "Warning\|warn(" | tee "$dir/serve.txt" \
    | grep -E "ready in|^---|request throughput|TTFT ms|GPU busy|host CPU|^  [A-Za-z]|bottleneck"
  python3 benchmarks/serve_trace.py /tmp/ray/session_latest/logs/serve > "$dir/trace.txt" 2>&1
  tar czf "$dir.tgz" -C "$OUT" "$label" && rm -rf "$dir"
done
ray stop --force >/dev/null 2>&1
