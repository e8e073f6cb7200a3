#!/bin/sh
# Runs several libFuzzer harnesses at once on a many-core machine, each for a given number of
# executions spread over parallel jobs, and reports what each did (docs/FUZZING.md quotes it).
#   tools/fuzz-parallel.sh FUZZ_DIR OUT_DIR name:jobs:runs [name:jobs:runs ...]
# FUZZ_DIR holds the fuzz_<name> binaries of a KR_FUZZ build (BUILD/fuzz, or a copy of it with a
# lib/ of the shared libraries they need beside it: tools/fuzz-pack.sh). Each harness runs `jobs`
# processes of `runs` executions in OUT_DIR/<name>/ (its logs fuzz-<i>.log, new inputs in corpus/,
# crashes in artifacts/), with the flags tools/fuzz.sh uses, from the checked-in corpus and
# dictionary of this tree. At the end, one line per harness: executions done (the sum of the jobs'
# "Done N runs"), the coverage a job reached, the artifacts written, the seconds taken.
# Environment: KR_FUZZ_SOURCE_DIR defaults to this tree (where the harnesses find their fixtures);
# FUZZ_SECONDS=S stops each job after S seconds (-max_total_time) whatever its runs; FUZZ_WORK=DIR
# keeps the new inputs in DIR/<name>/ instead of OUT_DIR/<name>/corpus/.
set -eu
fuzz=$(cd "${1:?usage: tools/fuzz-parallel.sh FUZZ_DIR OUT_DIR name:jobs:runs ...}" && pwd)
mkdir -p "${2:?OUT_DIR}"
out=$(cd "$2" && pwd)
shift 2
src=$(cd "$(dirname "$0")/.." && pwd)
export KR_FUZZ_SOURCE_DIR="${KR_FUZZ_SOURCE_DIR:-$src}"
[ -d "$fuzz/lib" ] && export LD_LIBRARY_PATH="$fuzz/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}" OMP_NUM_THREADS=1
t0=$(date +%s)
for spec in "$@"; do
    name=${spec%%:*}
    rest=${spec#*:}
    jobs=${rest%%:*}
    runs=${rest#*:}
    bin="$fuzz/fuzz_$name"
    [ -x "$bin" ] || { echo "fuzz-parallel: no $bin" >&2; exit 1; }
    dir="$out/$name"
    work="${FUZZ_WORK:+$FUZZ_WORK/$name}"
    work="${work:-$dir/corpus}"
    mkdir -p "$work" "$dir/artifacts"
    max_len=$(sed -n 's/.*fuzz-max-len: *\([0-9][0-9]*\).*/\1/p' "$src/tests/fuzz/fuzz_$name.c" | head -n 1)
    dict="$src/tests/fuzz/dict/$name.dict"
    set -- -max_len="${max_len:-65536}" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
        -artifact_prefix="$dir/artifacts/" -print_final_stats=1 -runs="$runs" -jobs="$jobs" -workers="$jobs"
    [ -f "$dict" ] && set -- "$@" -dict="$dict"
    [ -z "${FUZZ_SECONDS:-}" ] || set -- "$@" -max_total_time="$FUZZ_SECONDS"
    (cd "$dir" && s=$(date +%s) && "$bin" "$@" "$work" "$src/tests/fuzz/corpus/$name" > driver.log 2>&1;
     echo "rc=$? seconds=$(( $(date +%s) - s ))" > done) &
done
wait
for dir in "$out"/*/; do
    name=$(basename "$dir")
    [ -f "$dir/done" ] || continue
    done_runs=$(cat "$dir"/fuzz-*.log 2>/dev/null | sed -n 's/^Done \([0-9][0-9]*\) runs.*/\1/p' | awk '{s+=$1} END {print s+0}')
    cov=$(cat "$dir"/fuzz-*.log 2>/dev/null | sed -n 's/.* cov: \([0-9][0-9]*\) .*/\1/p' | sort -n | tail -n 1)
    arts=$(ls "$dir/artifacts" | wc -l)
    echo "$name: $done_runs executions, cov ${cov:-?}, $arts artifacts, $(cat "$dir/done")"
done
echo "total seconds: $(( $(date +%s) - t0 ))"
