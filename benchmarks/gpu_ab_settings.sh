#!/usr/bin/env bash
# Serving A/B of settings (not trees) on ONE device machine, alternating rounds, so that host-to-host
# spread does not pass for an effect. Run from the repository root with .gpu-deps carried:
#   bash benchmarks/gpu_ab_settings.sh CONFIG 'label={json}' 'label={json}' ... -- [serve.py args ...]
# e.g. bash benchmarks/gpu_ab_settings.sh configs/qwen3-vl-2b-gpu.yaml 'default={}' \
#        'own={"encoder": {"stream": "own"}}' -- --via port --router-port 8800 --workload image --concurrency 256
# Each label's JSON is deep-merged into the application args (serve.py --app-args). Results in
# $OUT/<round>_<label>/; ROUNDS (default 2) rounds; each serve.py run gets SERVE_TIMEOUT s.
set -uo pipefail
source benchmarks/gpu_env.sh
CONFIG=$1; shift
VARIANTS=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do VARIANTS+=("$1"); shift; done
[ $# -gt 0 ] && shift
MODEL=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']['model'])" "$CONFIG")
python3 -c "import sys; from app.checkpoints.model_builder import resolve_model; print('checkpoint', resolve_model(sys.argv[1], None))" "$MODEL" \
  | tee "$OUT/checkpoint.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for v in "${VARIANTS[@]}"; do
    label=${v%%=*}; args=${v#*=}
    dir="$OUT/${round}_${label}"; mkdir -p "$dir"
    ray stop --force >/dev/null 2>&1
    timeout "${SERVE_TIMEOUT:-240}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" \
      --no-progress --out-dir "$dir" --app-args "$args" "$@" 2>&1 | grep -v "Warning\|warn(" > "$dir/serve.txt"
    echo "== round $round, $label $args"
    grep -E "^---|request throughput|TTFT ms|encoder:|GPU busy|bottleneck" "$dir/serve.txt"
  done
done
ray stop --force >/dev/null 2>&1
