#!/usr/bin/env bash
# --batch-invariant on the GPU: the tests that check it bit for bit, then decode and prefill with and
# without it on a synthetic 8B checkpoint (docs/PERF.md, "Batch-invariant mode"), then `krait serve
# --batch-invariant` over HTTP on the default model and the synthetic checkpoint (invariant_http.py).
#   tests/gpu/invariant.sh [--build DIR] [--shape NAME] [--suites "a b"] [--deadline SECONDS]
# Logs and a summary go to $OUT (or ./gpu-out).
set -u
build=build-gpu shape=nemotron_h_8b suites="" deadline=560
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift ;;
    --shape) shape=$2; shift ;;
    --suites) suites=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    *) echo "invariant.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}
export KR_FIXTURES=$PWD/tests/fixtures
t_start=$(date +%s)
# shellcheck source=tests/gpu/deadline.sh
. "$(dirname "$0")/deadline.sh"
log=$out/invariant.log
{
  echo "# --batch-invariant $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
} > "$log"
bin=$build/tests/gpu/test_cuda
# the mode's test again under each measurement switch that changes a kernel it runs
for v in ${VARIANTS-KRAIT_DSA_SCORE=fp32 KRAIT_PDL=0}; do
  env "$v" timeout 120 "$bin" --filter 'cuda_backend/batch_invariant*' --jobs 4 > "$out/variant.tmp" 2>&1
  echo "== cuda_backend/batch_invariant* with $v rc=$?: $(grep -a 'Synthesis:' "$out/variant.tmp" | tail -1)" >> "$log"
  grep -a 'rows differ' "$out/variant.tmp" | head -4 >> "$log"
done
rm -f "$out/variant.tmp"
for f in 'gemm/fixed_order*' 'cuda_backend/batch_invariant*' 'cuda_invariant/*' $suites; do
  case $f in */*) ;; *) f="$f/*" ;; esac
  run_for 240 "$bin" --filter "$f" --jobs 4 --verbose=1 > "$out/test-${f%%/*}.log" 2>&1
  echo "== $f rc=$?: $(grep -a 'Synthesis:' "$out/test-${f%%/*}.log" | tail -1)" >> "$log"
done
synth=/tmp/krait-synth-$shape
if [ ! -f "$synth/config.json" ]; then
  PYTHONUNBUFFERED=1 run_for 200 python3 tools/bench/synth_model.py make --shape "$shape" --out "$synth" \
    > "$out/synth.log" 2>&1 || echo "synthetic checkpoint failed" >> "$log"
fi
if [ -f "$synth/config.json" ]; then
  # the same process order both ways, twice, so that the spread between processes shows
  # invariant-16: a process reserved for 16 sequences, whose decode rows take krk_skinny (with 64
  # reserved they take cuBLASLt, as prefill rows do)
  for mode in ${MODES:-plain invariant plain invariant invariant-16 invariant-16}; do
    args="--batches 1,16,64"
    [ "$mode" = invariant ] && args="--batch-invariant $args"
    [ "$mode" = invariant-16 ] && args="--batch-invariant --batches 1,16"
    echo "## $shape $mode" >> "$log"
    # shellcheck disable=SC2086
    run_for 150 "$build/bench/bench_cuda" $args --prefill 2048 --steps 24 "$synth" \
      > "$out/bench.tmp" 2>&1
    echo "bench_cuda rc=$?" >> "$out/bench.tmp"
    cat "$out/bench.tmp" >> "$out/bench.log"
    grep -Eai 'decode|prefill|device|error|krk|rc=' "$out/bench.tmp" >> "$log"
  done
fi
rm -f "$out/bench.tmp"
# served: each probe's tokens and log-probabilities alone and in a crowd of concurrent requests
# (some cut mid-stream), on the default model and on the synthetic checkpoint (token-id prompts)
if [ -x "$build/krait" ]; then
  for m in models/small-hybrid "$synth"; do
    [ -f "$m/config.json" ] || continue
    # the default model in a server of 16 sequences: its decode rows take krk_skinny
    extra="--serve-arg=--max-num-seqs=16"
    [ "$m" = "$synth" ] && extra="--max-prompt 2000 --token-hi 120000 --crowd 24"
    # shellcheck disable=SC2086
    PYTHONUNBUFFERED=1 run_for 150 python3 tests/stress/invariant_http.py --krait "$build/krait" --model "$m" \
      "--serve-arg=--max-model-len 4096" --probes 6 $extra --log "$out/serve-$(basename "$m").log" > "$out/serve.tmp" 2>&1
    echo "== invariant_http $(basename "$m") rc=$?: $(tail -1 "$out/serve.tmp")" >> "$log"
  done
  rm -f "$out/serve.tmp"
fi
echo "total $(( $(date +%s) - t_start )) s" >> "$log"
cat "$log"
