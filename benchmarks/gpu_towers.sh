#!/usr/bin/env bash
# Issue 16's GPU run for the Qwen2.5-VL and MiniCPM-V towers, in one device call (under 9 minutes on
# one H200): the towers' GPU tests, then the encoder benchmark for qwen2.5-vl-7b and minicpm-v-4.5
# (reference eager, our eager, our graphs), its JSON, table and log under $OUT.
#
#   bash benchmarks/gpu_towers.sh          (RUNS=50 for a shorter benchmark; default 100 timed runs)
#
# Each part has its own time limit so the benchmark always gets its share; the benchmark rewrites its
# JSON after each preset, so a run cut short keeps what it measured. Exit status: non-zero if either
# part failed.
set -uo pipefail

OUT=${OUT:-/tmp/gpu_towers}
RUNS=${RUNS:-100}
mkdir -p "$OUT"
if [ -f .gpu-deps/activate ]; then
  # shellcheck disable=SC1091
  source .gpu-deps/activate
fi
export PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python3 -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)"

echo "=== GPU tests: Qwen2.5-VL and MiniCPM-V towers ==="
timeout 260 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_qwen25_tower.py tests/test_minicpmv_tower.py \
  --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "GPU tests: exit $tests_rc after $((SECONDS - start)) s"

echo "=== encoder benchmark: qwen2.5-vl-7b, minicpm-v-4.5 ==="
left=$((525 - (SECONDS - start)))
timeout "$left" python3 benchmarks/encoder.py --presets qwen2.5-vl-7b minicpm-v-4.5 --runs "$RUNS" \
  --out "$OUT/encoder_towers.json" --scoreboard "$OUT/scoreboard.json" 2>&1 | tee "$OUT/encoder_towers.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: exit $bench_rc; total $((SECONDS - start)) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
