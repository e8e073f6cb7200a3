#!/usr/bin/env bash
# Runs every GPU test and benchmark on a GPU machine, from a build made elsewhere (it builds
# nothing) and prints a summary table last. Logs go to $OUT (or ./gpu-out) as one archive.
#   tests/gpu/run.sh [--build DIR] [--no-tests] [--no-bench] [--no-hf] [--shape NAME] [--synth DIR]
#                    [--bench-args "..."] [--deadline SECONDS] [--no-extras]
# --suites "a b": only these test suites (default: all).
# --no-extras: only the main benchmark, not the GEMV kernel comparison (bench_gemv), the run
# without programmatic dependent launch, the DSA top-k variants or the engine host-overhead runs.
# --deadline: the whole run's time (default 560 s); each stage gets at most what is left, a stage
# that would start with under 20 s left is skipped, and the logs are packed even when it is cut.
# --shape: a shape of tools/bench/synth_model.py (nemotron_h_8b, hybrid_dsa_8b, hybrid_mla_8b).
# Build first (on any machine with nvcc):
#   cmake -S . -B build-gpu -DKR_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j
#   then put the shared libraries the GPU machine lacks (libcriterion, ...) next to test_cuda,
#   bench_cuda and bench_sched
set -u
build=build-gpu suites="" tests=1 bench=1 extras=1 hf=1 shape=nemotron_h_8b synth= bench_args="" deadline=560
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift ;;
    --no-tests) tests=0 ;;
    --no-bench) bench=0 ;;
    --no-hf) hf=0 ;;
    --no-extras) extras=0 ;;
    --suites) suites=$2; shift ;;
    --synth) synth=$2; shift ;;
    --shape) shape=$2; shift ;;
    --bench-args) bench_args=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$synth" ] || synth=/tmp/krait-synth-$shape
out=${OUT:-$PWD/gpu-out}
logs=$(mktemp -d)
export LD_LIBRARY_PATH=$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}
export KR_FIXTURES=$PWD/tests/fixtures
summary=$logs/summary.md
t_start=$(date +%s)
# shellcheck source=tests/gpu/deadline.sh
. "$(dirname "$0")/deadline.sh"
{
  echo "# GPU run $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
  echo
  echo "| suite | passed | failed | crashed | skipped | seconds |"
  echo "|---|---|---|---|---|---|"
} > "$summary"

if [ $tests = 1 ]; then
  bin=$build/tests/gpu/test_cuda
  [ -n "$suites" ] || suites=$("$bin" --list 2>/dev/null | grep -av '^[│├└ ]' | cut -d: -f1)
  for suite in $suites; do
    s=$(date +%s)
    run_for 300 "$bin" --filter "$suite/*" --jobs 4 --verbose=1 > "$logs/$suite.log" 2>&1
    rc=$?
    e=$(( $(date +%s) - s ))
    syn=$(grep -a "Synthesis:" "$logs/$suite.log" | tail -1)
    p=$(echo "$syn" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p')
    f=$(echo "$syn" | sed -n 's/.*Failing: \([0-9]*\).*/\1/p')
    c=$(echo "$syn" | sed -n 's/.*Crashing: \([0-9]*\).*/\1/p')
    k=$(grep -ac "SKIP" "$logs/$suite.log")
    [ -z "$syn" ] && { p=?; f=?; c="rc=$rc"; }
    echo "| $suite | $p | $f | $c | $k | $e |" >> "$summary"
    echo "== $suite rc=$rc: $syn"
  done
fi

if [ $bench = 1 ]; then
  if [ ! -f "$synth/config.json" ]; then
    s=$(date +%s)
    PYTHONUNBUFFERED=1 run_for 300 python3 tools/bench/synth_model.py make --shape "$shape" --out "$synth" > "$logs/synth.log" 2>&1 \
      || echo "synthetic checkpoint failed (see synth.log)"
    echo "synthetic checkpoint: $(( $(date +%s) - s )) s" >> "$logs/synth.log"
  fi
  if [ -f "$synth/config.json" ]; then
    run_for 400 "$build/bench/bench_cuda" --profile --json "$logs/bench.jsonl" $bench_args "$synth" > "$logs/bench.md" 2>&1
    echo "bench_cuda rc=$?" >> "$logs/bench.md"
  fi
  if [ -f "$synth/config.json" ] && [ $extras = 1 ]; then
    # the GEMV kernel's configurations and cuBLAS on the decode step's weight shapes (no model needed)
    if [ -x "$build/bench/bench_gemv" ] && [ "$shape" = nemotron_h_8b ]; then
      run_for 120 "$build/bench/bench_gemv" --n 1,2,3,4,8,16,32,64 --json "$logs/gemv.jsonl" > "$logs/bench-gemv.md" 2>&1
      echo "bench_gemv rc=$?" >> "$logs/bench-gemv.md"
    fi
    # without programmatic dependent launch (the default launches every kernel as one), for comparison
    KRAIT_PDL=0 run_for 150 "$build/bench/bench_cuda" --batches 1,16,64 --prefill 512 --steps 24 "$synth" \
      > "$logs/bench-pdl.md" 2>&1
    echo "bench_cuda (KRAIT_PDL=0) rc=$?" >> "$logs/bench-pdl.md"
    # engine host overhead: the gap between back-to-back decode steps (16 and 64 sequences)
    if [ -x "$build/bench/bench_sched" ]; then
      for n in 16 64; do
        run_for 120 "$build/bench/bench_sched" "$synth" $n 48 cuda >> "$logs/bench-sched.md" 2>&1
        echo "bench_sched $n rc=$?" >> "$logs/bench-sched.md"
      done
    fi
  fi
  if [ -f "$synth/config.json" ]; then
    if [ $hf = 1 ]; then
      PYTHONUNBUFFERED=1 run_for 300 python3 tools/bench/synth_model.py hf-bench --model "$synth" --out "$logs/hf.json" \
        --budget-s ${HF_BUDGET_S:-150} > "$logs/hf.log" 2>&1
      echo "hf-bench rc=$?" >> "$logs/hf.log"
    fi
  fi
fi

{
  echo
  [ -f "$logs/bench.md" ] && grep -a '^|\|^device\|^model\|^cache\|rc=' "$logs/bench.md"
  [ -f "$logs/bench-gemv.md" ] && { echo; echo "GEMV kernels by weight shape:"; cat "$logs/bench-gemv.md"; }
  [ -f "$logs/bench-pdl.md" ] && { echo; echo "Without programmatic dependent launch (KRAIT_PDL=0):"; grep -a '^| prefill\|^| decode\|rc=' "$logs/bench-pdl.md"; }
  [ -f "$logs/bench-sched.md" ] && { echo; echo "Engine host overhead:"; cat "$logs/bench-sched.md"; }
  [ -f "$logs/hf.log" ] && { echo; echo "HF transformers:"; grep -av '^\s*$' "$logs/hf.log" | tail -12; }
  echo
  echo "total $(( $(date +%s) - t_start )) s"
} >> "$summary"
mkdir -p "$out"
cp "$summary" "$out/summary.md"
[ -f "$logs/bench.jsonl" ] && cp "$logs/bench.jsonl" "$out/"
[ -f "$logs/hf.json" ] && cp "$logs/hf.json" "$out/"
tar -C "$logs" -czf "$out/logs.tar.gz" .
# failures first (the reply shows the end of the output)
grep -aE "FAIL|\[----\].*:|Assertion|failed|CRASH" "$logs"/*.log 2>/dev/null | head -60
cat "$summary"
