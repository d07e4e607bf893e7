#!/usr/bin/env bash
# The GPU machine's bundle of missing packages WITH llguidance (the structured-output GPU test needs it),
# within the 64 MiB that one device call carries beside the tracked tree.
#   bash benchmarks/bundle_gpu_deps.sh [OUT_DIR]        (default .gpu-deps; then carry it and `source OUT_DIR/activate`)
# ../shared/gpu/bundle-deps with llguidance came to 58.2 MB, and the tree to 9.0 MB: 167 KB over the limit
# (2026-12-02). This repacks its archive without what a Serve app on the device never imports:
#   cryptography: Ray imports it only to make self-signed TLS certificates (ray/_common/tls_utils.py, lazily);
#   distlib and python_discovery: virtualenv's, which bundle-deps already drops.
# It fails if the result and the tracked tree together still pass the limit.
# PROFILE=1: py-spy in the bundle's bin/ (on PATH after `activate`) in place of llguidance, for a serving
# call that profiles (goodput.py --pyspy py-spy --pyspy-rate R): both do not fit beside the tree, and only
# the structured-output GPU test needs llguidance.
set -euo pipefail
OUT=${1:-.gpu-deps}
PKGS=(nvidia-ml-py orjson); [ -z "${PROFILE:-}" ] && PKGS+=(llguidance)
../shared/gpu/bundle-deps "$OUT" "${PKGS[@]}"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
tar -xJf "$OUT/site.tar.xz" -C "$W"
rm -rf "$W"/cryptography "$W"/cryptography-*.dist-info "$W"/distlib "$W"/distlib-*.dist-info \
  "$W"/python_discovery "$W"/python_discovery-*.dist-info
if [ -n "${PROFILE:-}" ]; then  # py-spy's static binary from its wheel
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$W/.whl" py-spy
  python3 -m zipfile -e "$W"/.whl/py_spy-*.whl "$W/.whl/x"
  mkdir -p "$W/bin" && cp "$W"/.whl/x/py_spy-*.data/scripts/py-spy "$W/bin/py-spy" && chmod +x "$W/bin/py-spy"
  rm -rf "$W/.whl"
else
  python3 -c "import sys; sys.path.insert(0, sys.argv[1]); import llguidance" "$W" 2>/dev/null \
    || ls -d "$W"/llguidance >/dev/null  # built for 3.12: importable only on the device; it must at least be there
fi
tar -C "$W" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
bundle=$(stat -c %s "$OUT/site.tar.xz")
# The tree weighed as a tar of the tracked files (each file's 512-byte header and padding count, erring high):
# the plain sum of sizes passed a 55.5 MB bundle beside a 10.9 MB tree that the device tool refused (2026-12-05).
tree=$(git ls-files -z | xargs -0 tar -cf - | wc -c)
echo "bundle $bundle B, tracked tree $tree B (as a tar), together $(( bundle + tree )) of $(( 64 * 1024 * 1024 )) B"
[ $(( bundle + tree )) -lt $(( 64 * 1024 * 1024 - 512 * 1024 )) ] || { echo "over the carry limit"; exit 1; }
