#!/usr/bin/env bash
# Packs the GPU test and benchmark binaries of a CUDA build, with the shared libraries a GPU machine
# may lack, with the server, into one archive that tests/gpu/run.sh, tests/gpu/spec.sh and
# tests/stress/gpu.sh run from once unpacked:
#   tools/gpu-pack.sh [BUILD] [ARCHIVE] [BASE]   (defaults: build-gpu, build-pack/run.tar.xz)
#   on the GPU machine: tar xJf build-pack/run.tar.xz && tests/gpu/run.sh --build build-run
# BASE: the CUDA build of an earlier commit whose bench_cuda goes in too, as build-run/base/bench/
# bench_cuda, for before/after figures in one call (tests/gpu/spec.sh --base build-run/base).
set -eu
build=${1:-build-gpu} archive=${2:-build-pack/run.tar.xz} base=${3:-}
rm -rf build-run
mkdir -p build-run/tests/gpu build-run/bench "$(dirname "$archive")"
cp "$build/krait" build-run/
cp "$build/tests/gpu/test_cuda" build-run/tests/gpu/
cp "$build/bench/bench_cuda" "$build/bench/bench_sched" "$build/bench/bench_gemv" build-run/bench/
bins="build-run/krait build-run/tests/gpu/test_cuda build-run/bench/bench_cuda build-run/bench/bench_sched build-run/bench/bench_gemv"
if [ -n "$base" ]; then
  mkdir -p build-run/base/bench
  cp "$base/bench/bench_cuda" build-run/base/bench/
  bins="$bins build-run/base/bench/bench_cuda"
fi
# shellcheck disable=SC2086
strip $bins
# every shared library the binaries load except the C runtime and the CUDA driver/toolkit ones
mkdir -p build-run/devlibs
# shellcheck disable=SC2086
ldd $bins |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas[^/]*|libnccl|libnvidia[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" build-run/devlibs/; done
tar -cJf "$archive" build-run
ls -la "$archive"
