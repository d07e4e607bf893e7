# Sourced by benchmarks/bundle_guidellm.sh and bundle_aiperf.sh: a third-party client for the GPU machine as
# a bundle of its own (Python 3.12 wheels from the package registry, less what the GPU image already has),
# with an `install` script that unpacks it once and prints the path of a command running it.
# The caller sets OUT and NAME (the tool's module and command), then: bundle_download SPEC; its requirements
# through bundle_download; bundle_unpack; any pruning of "$WORK/site"; bundle_pack.
set -euo pipefail
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# the GPU image's own builds (and torch's CUDA libraries, which only a CUDA torch wheel pulls in)
IMAGE='^(torch|nvidia|cusparselt|triton|sympy|mpmath|networkx|transformers|tokenizers|safetensors|huggingface_hub|hf_xet|numpy|setuptools|jinja2|markupsafe|MarkupSafe)[-_]'

bundle_download() {  # pip download ARGS... for the GPU image's Python and platform, into $WORK/whl
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$WORK/whl" "$@"
}

bundle_metadata() {  # the tool's own wheel's METADATA file (its requirements)
  python3 -m zipfile -e "$WORK"/whl/"$NAME"-*.whl "$WORK/meta" >/dev/null
  echo "$WORK"/meta/"$NAME"-*.dist-info/METADATA
}

bundle_unpack() {  # every downloaded wheel but the image's into $WORK/site
  mkdir -p "$WORK/site"
  for w in "$WORK"/whl/*.whl; do
    [[ "$(basename "$w")" =~ $IMAGE ]] && continue
    python3 -m zipfile -e "$w" "$WORK/site"
  done
}

bundle_pack() {  # $WORK/site -> $OUT/site.tar.xz and $OUT/install
  find "$WORK/site" -name '__pycache__' -type d -prune -exec rm -rf {} +
  mkdir -p "$OUT"
  tar -C "$WORK/site" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"
  sed "s/@NAME@/$NAME/g" > "$OUT/install" <<'INSTALL'
# bash .gpu-@NAME@/install  ->  unpacks the bundle beside this file once, prints the @NAME@ command
_d=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/gpu-@NAME@/.done ]; then
  mkdir -p /tmp/gpu-@NAME@/site && tar -xJf "$_d/site.tar.xz" -C /tmp/gpu-@NAME@/site && touch /tmp/gpu-@NAME@/.done
fi
cat > /tmp/gpu-@NAME@/@NAME@ <<'EXE'
#!/usr/bin/env bash
PYTHONPATH=/tmp/gpu-@NAME@/site exec python3 -m @NAME@ "$@"
EXE
chmod +x /tmp/gpu-@NAME@/@NAME@
echo /tmp/gpu-@NAME@/@NAME@
INSTALL
  du -sh "$OUT"/site.tar.xz
}
