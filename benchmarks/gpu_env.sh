# Sourced by the gpu_*.sh serving scripts on the device: $OUT, the carried bundle, and the machine's
# GPU and core count in $OUT/env.txt.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f .gpu-deps/activate ]; then source .gpu-deps/activate
elif [ -f /tmp/gpu-site/.done ]; then  # a call that carried another bundle, on a machine an earlier call unpacked
  export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/gpu-site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
nproc | tee -a "$OUT/env.txt"
