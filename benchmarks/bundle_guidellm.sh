#!/usr/bin/env bash
# GuideLLM for the GPU machine, for goodput.py's third-party cross-check (issue 45): a bundle of GuideLLM
# and what it needs beyond the GPU image (Python 3.12; torch, transformers, numpy and the Hugging Face
# hub are the image's), about 38 MB: too large to travel beside .gpu-deps (57 of the 64 MiB a call
# carries). So it goes in a call of its own, on a machine that an earlier call left warm with .gpu-deps
# unpacked in /tmp/gpu-site (benchmarks/gpu_env.sh finds it there when .gpu-deps is not carried):
#   call 1, carry .gpu-deps:       STAGES=one bash benchmarks/gpu_goodput.sh          (finds the goodput R)
#   call 2, carry .gpu-guidellm:   STAGES=crosscheck CROSSCHECK_RATE=R bash benchmarks/gpu_goodput.sh
# `.gpu-guidellm/install` unpacks it to /tmp/gpu-guidellm once and prints the path of a `guidellm`
# command that runs with the bundle alone on its PYTHONPATH (the server's processes never see it): what
# gpu_goodput.sh passes to goodput.py --crosscheck-exe.
# Built here from the package registry alone:
#   bash benchmarks/bundle_guidellm.sh [OUT_DIR]     (default .gpu-guidellm, ignored by git)
OUT=${1:-.gpu-guidellm}
NAME=guidellm
source "$(dirname "$0")/bundle_tool.sh"
bundle_download --no-deps "guidellm==${GUIDELLM_VERSION:-0.8.1}"
# its own requirements but torch and transformers (a CUDA torch wheel pulls 3 GB of CUDA libraries)
mapfile -t REQS < <(sed -n 's/^Requires-Dist: \([^;]*\)$/\1/p' "$(bundle_metadata)" | grep -vE '^(torch|transformers)\b')
bundle_download "${REQS[@]}"
bundle_unpack
# pyarrow's parts that `datasets` never loads for in-memory synthetic data: Flight, S3, Gandiva, headers,
# sources and tests (Substrait stays: libarrow_python links it)
rm -rf "$WORK"/site/pyarrow/{include,src,tests} "$WORK"/site/pandas/tests "$WORK"/site/pyarrow/_pyarrow_cpp_tests*.so \
  "$WORK"/site/pyarrow/libarrow_flight.so* "$WORK"/site/pyarrow/libarrow_python_flight.so* "$WORK"/site/pyarrow/_flight*.so \
  "$WORK"/site/pyarrow/libarrow_s3.so* "$WORK"/site/pyarrow/_s3fs*.so "$WORK"/site/pyarrow/*gandiva*
bundle_pack
