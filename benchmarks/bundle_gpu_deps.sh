#!/usr/bin/env bash
# The GPU machine's bundle of missing packages, with llguidance (the structured-output GPU test needs it) and
# py-spy (goodput.py --pyspy, gpu_profile_serving.sh), within the 64 MiB that one device call carries beside
# the tracked tree.
#   bash benchmarks/bundle_gpu_deps.sh [OUT_DIR]        (default .gpu-deps; then carry it and `source OUT_DIR/activate`)
# ../shared/gpu/bundle-deps with llguidance came to 58.2 MB beside a 9.0 MB tree (2026-12-02), so this repacks
# its archive:
#   - without what a Serve app on the device never imports: cryptography (Ray imports it only to make
#     self-signed TLS certificates, lazily), distlib and python_discovery (virtualenv's);
#   - with every unstripped shared object stripped of its symbol tables (`strip --strip-unneeded`, what a
#     loader never reads): 31 MB less unpacked and 6.6 MB less packed (2026-12-06), which is what makes room
#     for llguidance and py-spy together. Before that they did not both fit, and PROFILE=1 chose py-spy.
# It fails if the result and the tracked tree together still pass the limit.
set -euo pipefail
OUT=${1:-.gpu-deps}
PKGS=(nvidia-ml-py orjson llguidance)
../shared/gpu/bundle-deps "$OUT" "${PKGS[@]}"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
tar -xJf "$OUT/site.tar.xz" -C "$W"
rm -rf "$W"/cryptography "$W"/cryptography-*.dist-info "$W"/distlib "$W"/distlib-*.dist-info \
  "$W"/python_discovery "$W"/python_discovery-*.dist-info
# py-spy's static binary from its wheel
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d "$W/.whl" py-spy
python3 -m zipfile -e "$W"/.whl/py_spy-*.whl "$W/.whl/x"
mkdir -p "$W/bin" && cp "$W"/.whl/x/py_spy-*.data/scripts/py-spy "$W/bin/py-spy" && chmod +x "$W/bin/py-spy"
rm -rf "$W/.whl"
ls -d "$W"/llguidance >/dev/null  # built for 3.12: importable only on the device; it must at least be there
find "$W" -type f -name '*.so*' -print0 | while IFS= read -r -d '' f; do
  if file "$f" | grep -q 'not stripped'; then strip --strip-unneeded "$f"; fi
done
tar -C "$W" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
bundle=$(stat -c %s "$OUT/site.tar.xz")
# The tree weighed as a tar of the tracked files (each file's 512-byte header and padding count, erring high):
# the plain sum of sizes passed a 55.5 MB bundle beside a 10.9 MB tree that the device tool refused (2026-12-05).
tree=$(git ls-files -z | xargs -0 tar -cf - | wc -c)
echo "bundle $bundle B, tracked tree $tree B (as a tar), together $(( bundle + tree )) of $(( 64 * 1024 * 1024 )) B"
[ $(( bundle + tree )) -lt $(( 64 * 1024 * 1024 - 512 * 1024 )) ] || { echo "over the carry limit"; exit 1; }
