#!/usr/bin/env bash
# NVIDIA AIPerf for the GPU machine, for goodput.py's third-party cross-check (issue 45; `--crosscheck
# aiperf`): AIPerf sends from several worker processes, where GuideLLM's one process saturated at 140 req/s
# (2026-12-02). A bundle of AIPerf and what `aiperf profile` needs beyond the GPU image (Python 3.12; torch,
# transformers, numpy and the Hugging Face hub are the image's), about 27 MB: too large to travel beside
# .gpu-deps (55 of the 64 MiB a call carries), so it goes in a call of its own on a machine that an earlier
# call left warm with .gpu-deps unpacked in /tmp/gpu-site, as benchmarks/bundle_guidellm.sh's does:
#   call 1, carry .gpu-deps:     STAGES=one bash benchmarks/gpu_goodput.sh                       (goodput R)
#   call 2, carry .gpu-aiperf:   STAGES=crosscheck CROSSCHECK_RATE=R bash benchmarks/gpu_goodput.sh
# Left out of AIPerf's requirements: what its plots, dashboards, Kubernetes runs, parameter search,
# Parquet and audio or trace datasets import (dash, kaleido, plotly, matplotlib, seaborn, pandas, scipy,
# pyarrow, datasets, optuna, kopf, kubernetes-asyncio, textual, soundfile, tiktoken, sentencepiece,
# fastapi, uvicorn...). `aiperf profile` with synthetic images against this server ran without them
# (Python 3.12, the CPU server, 2026-12-04); a run that needs one fails with "No module named ...".
# `.gpu-aiperf/install` unpacks it to /tmp/gpu-aiperf once and prints the path of an `aiperf` command
# that runs with the bundle alone on its PYTHONPATH, beside the image's own packages (the server's processes
# never see it).
#   bash benchmarks/bundle_aiperf.sh [OUT_DIR]     (default .gpu-aiperf, ignored by git)
OUT=${1:-.gpu-aiperf}
NAME=aiperf
source "$(dirname "$0")/bundle_tool.sh"
bundle_download --no-deps "aiperf==${AIPERF_VERSION:-0.13.0}"
LEFT_OUT='^(torch|transformers|dash|dash-bootstrap-components|kaleido|kopf|kubernetes-asyncio|matplotlib|optuna|plotly|seaborn|scipy|pandas|textual|soundfile|datasets|pyarrow|starlette-compress|fastapi|uvicorn|python-multipart|aiosqlite|tiktoken|sentencepiece|nvidia-ml-py)\b'
mapfile -t REQS < <(grep '^Requires-Dist: ' "$(bundle_metadata)" | grep -v 'extra ==' |
  sed 's/^Requires-Dist: //; s/;.*$//' | grep -vE "$LEFT_OUT")
bundle_download "${REQS[@]}"
bundle_unpack
bundle_pack
