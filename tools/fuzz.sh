#!/bin/sh
# Runs the libFuzzer harnesses of a KR_FUZZ build (make fuzz calls this; docs/FUZZING.md).
#   tools/fuzz.sh BUILD_DIR            every harness in BUILD_DIR/fuzz, one after the other
# Environment:
#   FUZZ=name        only tests/fuzz/fuzz_<name>.c's harness
#   RUNS=N           executions per job (default 100000); FUZZ_SECONDS=S stops each job after S s
#   FUZZ_JOBS=J      parallel jobs per harness (default 1): J processes of RUNS executions each
#   FUZZ_MAX_LEN=B   largest input in bytes (default: the harness's "fuzz-max-len: B" line, else 65536)
#   FUZZ_MERGE=1     instead of fuzzing, minimise the checked-in corpus: the inputs of
#                    tests/fuzz/corpus/<name>/ and BUILD_DIR/fuzz-corpus/<name>/ that add coverage
#                    replace tests/fuzz/corpus/<name>/
# New inputs go to BUILD_DIR/fuzz-corpus/<name>/ (the checked-in corpus is only read); a crash,
# leak, timeout or out-of-memory input is saved as BUILD_DIR/fuzz-artifacts/<name>/<kind>-<sha1>
# and the script stops with the harness's status.
set -eu
build=$(cd "${1:?usage: tools/fuzz.sh BUILD_DIR}" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
runs=${RUNS:-100000}
jobs=${FUZZ_JOBS:-1}
found=0
for bin in "$build"/fuzz/fuzz_*; do
    [ -x "$bin" ] || continue
    name=${bin##*/fuzz_}
    [ -z "${FUZZ:-}" ] || [ "$FUZZ" = "$name" ] || continue
    found=1
    seeds="$src/tests/fuzz/corpus/$name"
    work="$build/fuzz-corpus/$name"
    art="$build/fuzz-artifacts/$name"
    mkdir -p "$seeds" "$work" "$art"
    max_len=${FUZZ_MAX_LEN:-$(sed -n 's/.*fuzz-max-len: *\([0-9][0-9]*\).*/\1/p' "$src/tests/fuzz/fuzz_$name.c" | head -n 1)}
    set -- -max_len="${max_len:-65536}" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -artifact_prefix="$art/" -print_final_stats=1
    dict="$src/tests/fuzz/dict/$name.dict"
    [ -f "$dict" ] && set -- "$@" -dict="$dict"
    if [ -n "${FUZZ_MERGE:-}" ]; then
        tmp=$(mktemp -d)
        echo "fuzz: $name: merging $seeds and $work"
        "$bin" "$@" -merge=1 "$tmp" "$seeds" "$work"
        rm -f "$seeds"/*
        cp "$tmp"/* "$seeds"/
        rm -rf "$tmp"
        echo "fuzz: $name: $(ls "$seeds" | wc -l) inputs, $(du -s --apparent-size -B1 "$seeds" | cut -f1) bytes"
        continue
    fi
    [ -z "${FUZZ_SECONDS:-}" ] || set -- "$@" -max_total_time="$FUZZ_SECONDS"
    if [ "$jobs" -gt 1 ]; then
        set -- "$@" -jobs="$jobs" -workers="$jobs"
    fi
    echo "fuzz: $name: $runs runs x $jobs job(s), max_len ${max_len:-65536}"
    (cd "$build" && "$bin" "$@" -runs="$runs" "$work" "$seeds")
done
if [ "$found" = 0 ]; then
    echo "fuzz: no harness${FUZZ:+ named $FUZZ} in $build/fuzz (configure with -DKR_FUZZ=ON)" >&2
    exit 1
fi
