#!/usr/bin/env bash
# The GPU machine's bundle of missing packages WITH llguidance (the structured-output GPU test needs it),
# within the 64 MiB that one device call carries beside the tracked tree.
#   bash benchmarks/bundle_gpu_deps.sh [OUT_DIR]        (default .gpu-deps; then carry it and `source OUT_DIR/activate`)
# ../shared/gpu/bundle-deps with llguidance came to 58.2 MB, and the tree to 9.0 MB: 167 KB over the limit
# (2026-12-02). This repacks its archive without what a Serve app on the device never imports:
#   cryptography: Ray imports it only to make self-signed TLS certificates (ray/_common/tls_utils.py, lazily);
#   distlib and python_discovery: virtualenv's, which bundle-deps already drops.
# It fails if the result and the tracked tree together still pass the limit.
set -euo pipefail
OUT=${1:-.gpu-deps}
../shared/gpu/bundle-deps "$OUT" nvidia-ml-py orjson llguidance
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
tar -xJf "$OUT/site.tar.xz" -C "$W"
rm -rf "$W"/cryptography "$W"/cryptography-*.dist-info "$W"/distlib "$W"/distlib-*.dist-info \
  "$W"/python_discovery "$W"/python_discovery-*.dist-info
python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import llguidance" "$W" 2>/dev/null \
  || ls -d "$W"/llguidance >/dev/null  # built for 3.12: importable only on the device; it must at least be there
tar -C "$W" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
bundle=$(stat -c %s "$OUT/site.tar.xz")
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
echo "bundle $bundle B, tracked tree $tree B, together $(( bundle + tree )) of $(( 64 * 1024 * 1024 )) B"
[ $(( bundle + tree )) -lt $(( 64 * 1024 * 1024 - 512 * 1024 )) ] || { echo "over the carry limit"; exit 1; }
