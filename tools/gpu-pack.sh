#!/usr/bin/env bash
# Packs the GPU test and benchmark binaries of a CUDA build, with the shared libraries a GPU machine
# may lack, into one archive that tests/gpu/run.sh runs from once unpacked:
#   tools/gpu-pack.sh [BUILD] [ARCHIVE]   (defaults: build-gpu, build-pack/run.tar.xz)
#   on the GPU machine: tar xJf build-pack/run.tar.xz && tests/gpu/run.sh --build build-run
set -eu
build=${1:-build-gpu} archive=${2:-build-pack/run.tar.xz}
rm -rf build-run
mkdir -p build-run/tests/gpu build-run/bench "$(dirname "$archive")"
cp "$build/tests/gpu/test_cuda" build-run/tests/gpu/
cp "$build/bench/bench_cuda" "$build/bench/bench_sched" "$build/bench/bench_gemv" build-run/bench/
strip build-run/tests/gpu/test_cuda build-run/bench/bench_cuda build-run/bench/bench_sched build-run/bench/bench_gemv
# every shared library the binaries load except the C runtime and the CUDA driver/toolkit ones
mkdir -p build-run/devlibs
ldd build-run/tests/gpu/test_cuda build-run/bench/bench_cuda build-run/bench/bench_sched build-run/bench/bench_gemv |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas[^/]*|libnccl|libnvidia[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" build-run/devlibs/; done
tar -cJf "$archive" build-run
ls -la "$archive"
