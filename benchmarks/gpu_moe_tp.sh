#!/usr/bin/env bash
# One device call for models beyond one GPU (issue: MoE and tensor parallelism): the GPU tests of the
# MoE kernel, the MoE engine and tensor parallelism, the kernel benchmark, then decode speed per shape.
# Run from the repository root on the GPU machine, with .gpu-deps carried:
#   STAGES="tests kernel moe30b" bash benchmarks/gpu_moe_tp.sh          (results under $OUT)
# Stages: tests, tptest (the multi-GPU test alone), kernel, moe30b, dense8b, dense32b_tp, moe30b_tp, moe235b_tp4 (reduced to LAYERS_235B layers).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu-deps/activate
export PYTHONUNBUFFERED=1 VLM_SERVE_CACHE=/tmp/vlm-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
STAGES=${STAGES:-"tests kernel moe30b"}
run() { echo "== $1"; shift; "$@" 2>&1 | grep -v Warning | tail -${TAIL:-15}; }
for s in $STAGES; do case $s in
  tests) run tests timeout 400 python3 -m pytest -q -rs -m gpu tests/test_fused_moe.py tests/test_llm_moe.py \
           tests/test_tensor_parallel.py tests/test_llm_kernels.py -p no:cacheprovider ;;
  tptest) run tptest timeout 200 python3 -m pytest -q -rs -m gpu tests/test_tensor_parallel.py -p no:cacheprovider ;;
  kernel) run kernel timeout 200 python3 benchmarks/moe_kernel.py --out "$OUT/moe_kernel.json" ;;
  moe30b) run moe30b timeout 400 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --out "$OUT/moe30b.json" ;;
  dense8b) run dense8b timeout 300 python3 benchmarks/decode.py --preset qwen3-vl-8b --out "$OUT/dense8b.json" ;;
  dense32b_tp) run dense32b_tp1 timeout 240 python3 benchmarks/decode.py --preset qwen3-vl-32b --max-num-seqs 64 \
                 --gpu-memory-utilization 0.9 --out "$OUT/dense32b_tp1.json"
               run dense32b_tp2 timeout 240 python3 benchmarks/decode.py --preset qwen3-vl-32b --tp 2 --out "$OUT/dense32b_tp2.json" ;;
  moe30b_tp) run moe30b_tp2 timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --tp 2 --moe tp --out "$OUT/moe30b_tp2.json"
             run moe30b_ep2 timeout 200 python3 benchmarks/decode.py --preset qwen3-vl-30b-a3b --tp 2 --moe ep --out "$OUT/moe30b_ep2.json" ;;
  moe235b_tp4) run moe235b_tp4 timeout 500 python3 benchmarks/decode.py --preset qwen3-vl-235b-a22b \
                 --layers "${LAYERS_235B:-24}" --tp 4 --out "$OUT/moe235b_tp4.json" ;;
esac; done
