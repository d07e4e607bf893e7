#!/usr/bin/env bash
# One device call that measures how serving scales from one GPU to all of a host's GPUs, through Ray
# Serve's HTTP proxy and through the Routers' own shared port (app/api/shared_port.py), one run after
# the other on the same machine. From the repository root with .gpu-deps carried:
#   RUNS="proxy:1 proxy:2 port:1 port:2" bash benchmarks/gpu_scaling.sh CONFIG [serve.py args ...]
# e.g. ... configs/qwen3-vl-2b-gpu.yaml --workload image --concurrency 64 256 512 --num-requests 1024 --warmup 32
# A run is PATH:GPUS. Port runs pin the Routers at ROUTERS_PER_GPU per GPU when it is set (otherwise
# they autoscale: app.autoscaling.RouterAutoscalingPolicy counts the port's requests);
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
python3 -c "import sys, yaml; from app.model_builder import resolve_model
a = yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']; print('model at', resolve_model(a['model'], a.get('cache_dir')))" "$CONFIG"
for run in ${RUNS:-proxy:1 proxy:2 port:2}; do
  path=${run%%:*}; gpus=${run#*:}
  label="${path}x${gpus}${TAG:-}"; dir="$OUT/$label"; mkdir -p "$dir"
  config="$dir/config.yaml"; extra=(--via proxy); routers=0
  if [ "$path" = port ]; then routers=$(( ${ROUTERS_PER_GPU:-0} * gpus )); extra=(--via port --router-port 8800); fi
  python3 - "$CONFIG" "$config" "$routers" "$(( ${MEDIA_PER_GPU:-0} * gpus ))" "${ROUTER_SAMPLE:-}" <<'EOF'
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
routers, media, sample = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
for d in cfg["applications"][0]["deployments"]:
    scaling = d.get("autoscaling_config", {})
    if d["name"] == "Router" and routers:  # the presets leave the Routers' autoscaling to the builder
        d["autoscaling_config"] = {"target_ongoing_requests": 64, **scaling, "min_replicas": routers,
                                   "max_replicas": routers,
                                   "policy": {"policy_function": "app.autoscaling:RouterAutoscalingPolicy"}}
    if d["name"] == "MediaPreprocessor" and media:  # the presets leave it to the builder as well
        d["autoscaling_config"] = {"target_ongoing_requests": 2, "look_back_period_s": 15, "upscale_delay_s": 3,
                                   "downscale_delay_s": 120, **scaling, "min_replicas": media,
                                   # the builder's ceiling: half the cores, at least twice the floor
                                   "max_replicas": max(2 * media, (os.cpu_count() or 2) // 2,
                                                       scaling.get("max_replicas", 0))}
    if d["name"] == "LLM" and sample:  # replaces the builder's whole request_router_config
        from deployments.app import LLM_REQUEST_ROUTER, ROUTING_STATS_PERIOD_S
        d["request_router_config"] = {"request_router_class": LLM_REQUEST_ROUTER,
                                      "request_router_kwargs": {"sample": int(sample)},
                                      "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
                                      "request_routing_stats_timeout_s": 5 * ROUTING_STATS_PERIOD_S}
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
