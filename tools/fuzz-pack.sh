#!/bin/sh
# Copies the harnesses of a KR_FUZZ build into OUT with the shared libraries they load that a bare
# machine lacks (OUT/lib: libmicrohttpd, libuv, jansson, PCRE2, utf8proc, libsodium, libomp, ...),
# debug info stripped (function names kept for the sanitizers' reports), so that
# tools/fuzz-parallel.sh can run them on another machine of the same distribution.
#   tools/fuzz-pack.sh BUILD_DIR OUT_DIR
set -eu
build=${1:?usage: tools/fuzz-pack.sh BUILD_DIR OUT_DIR}
out=${2:?OUT_DIR}
mkdir -p "$out/lib"
for bin in "$build"/fuzz/fuzz_*; do
    [ -x "$bin" ] || continue
    strip --strip-debug -o "$out/${bin##*/}" "$bin"
    ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
        case "${lib##*/}" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
        *) [ -f "$out/lib/${lib##*/}" ] || cp -L "$lib" "$out/lib/" ;;
        esac
    done
done
du -sh "$out"
