#!/usr/bin/env bash
# Optional Hopper kernels for `benchmarks/tower_kernels.py fa4_attention quack_gemms`: FlashAttention-4's
# forward and QuACK's GEMMs, both written in NVIDIA's CuTe DSL. Nothing in app/ uses them yet; the
# probe measures whether they beat cuDNN / our Triton attention and cuBLAS at the tower's shapes.
#
# The GPU machine reaches no registry, so the wheels are fetched here and carried. The DSL's compiler
# library (nvidia-cutlass-dsl-libs-cu13, a 92 MB wheel) is over the 64 MiB one device call carries,
# so it travels alone, repacked with xz (61 MiB), in a first call; the other wheels (10 MiB) go in
# the next call, made within the 30 s the machine stays warm.
#
#   here:            benchmarks/hopper_kernels.sh pack            -> .hopper-kernels/{libs.tar.xz,wheels/}
#   device, call 1:  benchmarks/hopper_kernels.sh unpack-libs     (carry .hopper-kernels/libs.tar.xz)
#   device, call 2:  benchmarks/hopper_kernels.sh unpack-wheels   (carry .hopper-kernels/wheels), then
#                    PYTHONPATH=$(benchmarks/hopper_kernels.sh pythonpath) python3 benchmarks/tower_kernels.py fa4_attention quack_gemms
set -euo pipefail

DIR=.hopper-kernels
SITE=/tmp/hopper-site
PY=3.12  # the GPU image's python
PLATFORM=manylinux_2_28_x86_64
LIBS=nvidia-cutlass-dsl-libs-cu13==4.8.1
WHEELS="flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"

download() {  # into $1
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --platform "$PLATFORM" -d "$1" "${@:2}"
}

case "${1:-}" in
  pack)
    rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$DIR/tmp/libs"
    # shellcheck disable=SC2086
    download "$DIR/wheels" $WHEELS
    download "$DIR/tmp" "$LIBS"
    python3 -m zipfile -e "$DIR"/tmp/*.whl "$DIR/tmp/libs"
    tar -C "$DIR/tmp/libs" -cf - . | xz -9e -T0 >"$DIR/libs.tar.xz"  # a few minutes on 2 cores
    rm -rf "$DIR/tmp"
    du -sh "$DIR"/* ;;
  unpack-libs)
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$DIR/libs.tar.xz" ;;
  unpack-wheels)
    mkdir -p "$SITE" && for w in "$DIR"/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done ;;
  pythonpath)  # the wheels' .pth adds dsl_packages; a PYTHONPATH entry processes no .pth, so name it
    echo "$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD" ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
