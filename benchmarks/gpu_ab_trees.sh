#!/usr/bin/env bash
# Serving A/B of two source trees on ONE device machine, alternating, so that host-to-host spread
# (25% between machines of one kind, RESULTS.md) does not pass for a regression. Run from the
# repository root with .gpu-deps carried; results in $OUT/<round>_<old|new>/:
#   bash benchmarks/gpu_ab_trees.sh OLD_TREE CONFIG [serve.py args ...]
# OLD_TREE is an older commit's files inside this tree, untracked so that they travel, e.g.
#   mkdir ab_old && git archive 165072d app deployments configs benchmarks serve_config.yaml \
#     pyproject.toml | tar x -C ab_old
# The embedded checkpoint is built once first (both trees use ~/.cache/vlm-serve), so neither side's
# first start pays for it; each side runs its own copy of CONFIG (an old tree may refuse keys added
# since). ROUNDS (default 2) old/new pairs; each serve.py run gets SERVE_TIMEOUT s.
set -uo pipefail
source benchmarks/gpu_env.sh
OLD=$1; CONFIG=$2; shift 2
NEW=$PWD
MODEL=$(python3 -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']['model'])" "$CONFIG")
python3 -c "import sys; from app.checkpoints.model_builder import resolve_model; print('checkpoint', resolve_model(sys.argv[1], None))" "$MODEL" \
  | tee "$OUT/checkpoint.txt"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    tree=$([ "$side" = old ] && echo "$OLD" || echo "$NEW")
    dir="$OUT/${round}_${side}"; mkdir -p "$dir"
    ray stop --force >/dev/null 2>&1
    (cd "$tree" && timeout "${SERVE_TIMEOUT:-240}" python3 benchmarks/serve.py --start --serve-config "$CONFIG" \
      --no-progress --out-dir "$dir" "$@" 2>&1 | grep -v "Warning\|warn(" > "$dir/serve.txt")
    echo "== round $round, $side ($tree)"; grep -E "^---|request throughput|TTFT ms|bottleneck" "$dir/serve.txt"
  done
done
ray stop --force >/dev/null 2>&1
