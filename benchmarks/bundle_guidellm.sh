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
set -euo pipefail
OUT=${1:-.gpu-guidellm}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PIP=(python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
     --platform any -d "$WORK/whl")
"${PIP[@]}" --no-deps "guidellm==${GUIDELLM_VERSION:-0.8.1}"
# its own requirements but torch and transformers (a CUDA torch wheel pulls 3 GB of CUDA libraries)
mapfile -t REQS < <(python3 -m zipfile -e "$WORK"/whl/guidellm-*.whl "$WORK/meta" >/dev/null &&
  sed -n 's/^Requires-Dist: \([^;]*\)$/\1/p' "$WORK"/meta/guidellm-*.dist-info/METADATA | grep -vE '^(torch|transformers)\b')
"${PIP[@]}" "${REQS[@]}"
# the GPU image's own builds (and torch's CUDA libraries, which only a CUDA torch wheel pulls in)
IMAGE='^(torch|nvidia|cusparselt|triton|sympy|mpmath|networkx|transformers|tokenizers|safetensors|huggingface_hub|hf_xet|numpy|setuptools|jinja2|markupsafe|MarkupSafe)[-_]'
mkdir -p "$WORK/site"
for w in "$WORK"/whl/*.whl; do
  [[ "$(basename "$w")" =~ $IMAGE ]] && continue
  python3 -m zipfile -e "$w" "$WORK/site"
done
# pyarrow's parts that `datasets` never loads for in-memory synthetic data: Flight, S3, Gandiva, headers,
# sources and tests (Substrait stays: libarrow_python links it)
rm -rf "$WORK"/site/pyarrow/{include,src,tests} "$WORK"/site/pandas/tests "$WORK"/site/pyarrow/_pyarrow_cpp_tests*.so \
  "$WORK"/site/pyarrow/libarrow_flight.so* "$WORK"/site/pyarrow/libarrow_python_flight.so* "$WORK"/site/pyarrow/_flight*.so \
  "$WORK"/site/pyarrow/libarrow_s3.so* "$WORK"/site/pyarrow/_s3fs*.so "$WORK"/site/pyarrow/*gandiva*
find "$WORK/site" -name '__pycache__' -type d -prune -exec rm -rf {} +
mkdir -p "$OUT"
tar -C "$WORK/site" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
cat > "$OUT/install" <<'INSTALL'
# bash .gpu-guidellm/install  ->  unpacks the bundle beside this file once, prints the guidellm command
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/gpu-guidellm/.done ]; then
  mkdir -p /tmp/gpu-guidellm/site && tar -xJf "$_d/site.tar.xz" -C /tmp/gpu-guidellm/site && touch /tmp/gpu-guidellm/.done
fi
cat > /tmp/gpu-guidellm/guidellm <<'EXE'
#!/usr/bin/env bash
PYTHONPATH=/tmp/gpu-guidellm/site exec python3 -m guidellm "$@"
EXE
chmod +x /tmp/gpu-guidellm/guidellm
echo /tmp/gpu-guidellm/guidellm
INSTALL
du -sh "$OUT"/site.tar.xz
