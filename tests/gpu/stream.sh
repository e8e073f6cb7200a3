#!/usr/bin/env bash
# krk_stream_gemm (KRAIT_STREAM_GEMM) on the GPU, the runs that decide the switch's default:
#  1. its tests (gemm/stream*: products against the CPU, the fixed-class rows bit for bit), under a
#     timeout since a wrong barrier phase hangs rather than fails;
#  2. bench_gemv at 16, 32 and 64 rows: its weight rate against the copy rate, cuBLAS and cuBLASLt's
#     fastest algorithm (issue #31 item 2 asks 90 % of the copy rate);
#  3. the backend's suites with the switch at 1 (cuda_backend, cuda_invariant, gemm/invariant*);
#  4. on a synthetic 8B checkpoint: bench_cuda --batch-invariant at 1, 16 and 64 sequences, one
#     process each (the invariant path is chosen by the sequences a process reserves for), with the
#     switch at 1; plain decode at 1, 16, 32 and 64 sequences with the switch at 0 and 1; then
#     --batch-invariant again with the switch at 0 (what the switch replaces).
#   tests/gpu/stream.sh [--build DIR] [--shape NAME] [--synth DIR] [--reps N] [--deadline SECONDS]
# Logs and a summary (summary.md, printed last) go to $OUT (or ./gpu-out). Builds nothing: see
# tests/gpu/run.sh for the build and the libraries to put in DIR/devlibs.
set -u
build=build-gpu shape=nemotron_h_8b synth='' reps=10 deadline=560
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift ;;
    --shape) shape=$2; shift ;;
    --synth) synth=$2; shift ;;
    --reps) reps=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    *) echo "stream.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$synth" ] || synth=/tmp/krait-synth-$shape
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}
export KR_FIXTURES=$PWD/tests/fixtures
t_start=$(date +%s)
# shellcheck source=tests/gpu/deadline.sh
. "$(dirname "$0")/deadline.sh"
summary=$out/summary.md
{
  echo "# krk_stream_gemm $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
  echo
  echo "| run | rc | result |"
  echo "|---|---|---|"
} > "$summary"
bin=$build/tests/gpu/test_cuda
# a test run: its Criterion synthesis line in the summary
suite() {
  local name=$1 sw=$2 filter=$3 budget=$4 log=$out/$1.log
  KRAIT_STREAM_GEMM=$sw run_for "$budget" "$bin" --verbose=1 --jobs 4 --filter "$filter" > "$log" 2>&1
  local rc=$? syn
  syn=$(grep -a "Synthesis:" "$log" | tail -1 | sed 's/.*Synthesis: //; s/ | /, /g; s/ *$//')
  [ $rc = 124 ] && syn="timed out (a hang: look at the barrier phases)"
  [ $rc = 77 ] && syn="skipped: no GPU"
  echo "| $name (KRAIT_STREAM_GEMM=$sw) | $rc | ${syn:-no synthesis line} |" >> "$summary"
  echo "== $name rc=$rc: $syn"
}

# the synthetic checkpoint meanwhile (CPU and disk bound)
if [ ! -f "$synth/config.json" ]; then
  (PYTHONUNBUFFERED=1 run_for 300 python3 tools/bench/synth_model.py make --shape "$shape" --out "$synth" \
     > "$out/synth.log" 2>&1; echo "synth rc=$?" >> "$out/synth.log") &
  synth_pid=$!
else
  synth_pid=
fi

suite stream 0 "gemm/stream*" 90
run_for 120 "$build/bench/bench_gemv" --n 16,32,64 --reps "$reps" > "$out/gemv.md" 2>&1
echo "| bench_gemv --n 16,32,64 | $? | gemv.md |" >> "$summary"
suite cuda_backend 1 "cuda_backend/*" 200
suite cuda_invariant 1 "cuda_invariant/*" 100
suite gemm_invariant 1 "gemm/invariant*" 60
[ -n "$synth_pid" ] && wait "$synth_pid"
if [ -f "$synth/config.json" ]; then
  # one invariant process per batch size: switch 1 first, plain decode, then switch 0
  invariant() {
    local sw=$1 b
    for b in 1 16 64; do
      KRAIT_STREAM_GEMM=$sw run_for 90 "$build/bench/bench_cuda" --batch-invariant --batches $b --prefill 512 \
        --steps 24 "$synth" >> "$out/invariant-$sw.md" 2>&1
      echo "| bench_cuda --batch-invariant --batches $b (KRAIT_STREAM_GEMM=$sw) | $? | invariant-$sw.md |" >> "$summary"
    done
  }
  invariant 1
  for sw in 0 1; do
    KRAIT_STREAM_GEMM=$sw run_for 100 "$build/bench/bench_cuda" --batches 1,16,32,64 --prefill 512 --steps 24 \
      "$synth" > "$out/decode-$sw.md" 2>&1
    echo "| bench_cuda --batches 1,16,32,64 (KRAIT_STREAM_GEMM=$sw) | $? | decode-$sw.md |" >> "$summary"
  done
  invariant 0
else
  echo "| synthetic checkpoint | - | not made: synth.log |" >> "$summary"
fi
{
  echo
  for f in gemv decode-0 decode-1 invariant-0 invariant-1; do
    [ -f "$out/$f.md" ] && { echo "$f:"; grep -a '^|\|^device\|^copy\|rows' "$out/$f.md"; echo; }
  done
  echo "total $(( $(date +%s) - t_start )) s"
} >> "$summary"
grep -aE "FAIL|\[----\].*:|Assertion|CRASH" "$out"/*.log 2>/dev/null | head -40
cat "$summary"
