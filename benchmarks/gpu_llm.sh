#!/usr/bin/env bash
# One device call for the LLM engine: environment, the GPU tests, then benchmarks/llm.py.
# Run from the repository root on the GPU machine, with .gpu-deps carried:
#   bash benchmarks/gpu_llm.sh [pytest selection]     (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu-deps/activate
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
SEL=${1:-tests/test_llm.py tests/test_llm_batching.py}
timeout 300 python3 -m pytest -q -m gpu $SEL -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
timeout 330 python3 benchmarks/llm.py --profile --out "$OUT/llm.json" 2>&1 | tee "$OUT/llm_bench.txt" | grep -v Warning | tail -30
