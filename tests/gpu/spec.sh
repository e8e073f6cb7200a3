#!/usr/bin/env bash
# Speculative decoding on a GPU machine, in one call that keeps within a deadline, from a build made
# elsewhere (tools/gpu-pack.sh; it builds nothing). Stages (--stages, default all, in this order):
#   cost   bench_cuda's verification steps against plain decode steps on a synthetic 8B checkpoint
#          (--shape, default hybrid_dsa_8b): --batches 1,16,64 --prefill 2048 --ctx 1024 --steps 16
#          --spec 1,3; with --base DIR, the same run of DIR's bench_cuda first and again last (an
#          earlier build, for before/after figures on the same card);
#   mtp    `krait serve models/small-hybrid` with its MTP head drafting 3 tokens, under
#          tests/stress/stress.py's GPU profile: prompts up to max_model_len alone and 4 at once, the
#          disconnect storm (256 streams, most cut by their clients mid-draft), mixed traffic
#          (sampling, logprobs, stop strings, n), SIGTERM under load;
#   ngram  the same phases on the synthetic checkpoint served with --max-model-len 131072 and n-gram
#          drafts (prompt_lookup_min 1, max 4); its prompts repeat a random block of 64 ids
#          (stress.py --prompt-period), so that drafts are proposed although its weights are random.
# Logs and a summary go to $OUT (or ./spec-gpu-out): spec-summary.md and spec-gpu.tar.gz.
#   tests/gpu/spec.sh [--build DIR] [--base DIR] [--deadline SECONDS] [--stages cost,mtp,ngram]
#                     [--shape NAME] [--synth-root DIR]
# --build holds krait, bench/bench_cuda and devlibs/ (tools/gpu-pack.sh's build-run); --base holds
# bench/bench_cuda (and devlibs/ if it needs other libraries). The exit status is 1 when a stage
# failed or was cut.
set -u
build=build-run base="" deadline=560 stages=cost,mtp,ngram shape=hybrid_dsa_8b root=/tmp
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift ;;
    --base) base=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    --stages) stages=$2; shift ;;
    --shape) shape=$2; shift ;;
    --synth-root) root=$2; shift ;;
    *) echo "spec.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
t_start=$(date +%s)
# shellcheck source=tests/gpu/deadline.sh
. "$(dirname "$0")/deadline.sh"
out=${OUT:-$PWD/spec-gpu-out}
logs=$(mktemp -d)
summary=$logs/spec-summary.md
export LD_LIBRARY_PATH=$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
status=0
say() { echo "$*"; echo "$*" >> "$summary"; }
has() { case ",$stages," in *",$1,"*) return 0 ;; esac; return 1; }
{
  echo "# Speculative decoding on the GPU, $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
  echo "build: $build; base: ${base:-none}; stages: $stages; deadline $deadline s"
  echo
} > "$summary"
synth=$root/krait-stress-$shape
need_synth() {
  [ -f "$synth/config.json" ] && return 0
  local b s rc
  b=$(left 240)
  [ "$b" = 0 ] && { say "checkpoint: skipped, deadline reached"; return 1; }
  s=$(date +%s)
  timeout "$b" python3 tools/bench/synth_model.py make --shape "$shape" --out "$synth" --max-pos 131072 \
    --skip-existing > "$logs/synth.log" 2>&1
  rc=$?
  say "checkpoint $shape: rc=$rc in $(( $(date +%s) - s )) s"
  [ $rc = 0 ] && [ -f "$synth/config.json" ]
}
bench_spec() { # $1: label, $2: the bench_cuda binary, $3: its library folder
  local b s rc
  b=$(left 150)
  [ "$b" = 0 ] && { say "bench ($1): skipped, deadline reached"; status=1; return; }
  s=$(date +%s)
  LD_LIBRARY_PATH=$PWD/$3:$LD_LIBRARY_PATH timeout "$b" "$2" --batches 1,16,64 --prefill 2048 --ctx 1024 \
    --steps 16 --spec 1,3 --json "$logs/cost-$1.jsonl" "$synth" > "$logs/cost-$1.md" 2>&1
  rc=$?
  [ $rc != 0 ] && status=1
  say "bench ($1): rc=$rc in $(( $(date +%s) - s )) s"
  { echo; echo "### $1"; grep -a '^|\|^device\|^model\|^cache\|^copy\|GB/s' "$logs/cost-$1.md"; echo; } >> "$summary"
}
serve_stress() { # $1: label, $2: model, $3: max-model-len, $4: phases, $5: speculative config, $6..: stress.py args
  local label=$1 model=$2 mml=$3 phases=$4 spec=$5 b s rc pid
  shift 5
  mkdir -p "$logs/$label"
  b=$(left 280)
  [ "$b" -lt 60 ] && { say "$label: skipped, $b s left"; status=1; return; }
  s=$(date +%s)
  timeout $(( b + 30 )) python3 tests/stress/stress.py --profile gpu --krait "$build/krait" --model "$model" \
    --max-model-len "$mml" --serve-arg="--speculative-config $spec" --phases "$phases" --deadline "$b" \
    --out "$logs/$label" "$@" > "$logs/$label/stress.log" 2>&1
  rc=$?
  [ $rc != 0 ] && status=1
  pid=$(cat "$logs/$label/server.pid" 2>/dev/null)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q krait "/proc/$pid/cmdline" 2>/dev/null; then
    kill -9 "$pid"; say "$label: its server $pid was still running: killed"
  fi
  say "$label: rc=$rc in $(( $(date +%s) - s )) s"
  { echo; sed -n '/^| phase |/,$p' "$logs/$label/stress.log"; echo; } >> "$summary"
  # what the server counted: the speculative counters of its last /metrics read, when kept
  grep -a "spec_decode" "$logs/$label/stress.log" | tail -8 >> "$summary"
}

if has cost; then
  say "## cost: verification steps against plain decode ($shape)"
  if need_synth; then
    [ -n "$base" ] && bench_spec base1 "$base/bench/bench_cuda" "$base/devlibs"
    bench_spec head "$build/bench/bench_cuda" "$build/devlibs"
    [ -n "$base" ] && bench_spec base2 "$base/bench/bench_cuda" "$base/devlibs"
  else
    status=1
  fi
fi
if has mtp; then
  say "## mtp: models/small-hybrid, MTP drafts (k = 3), stress phases"
  mml=$(python3 -c "import json; print(json.load(open('models/small-hybrid/config.json'))['max_position_embeddings'])")
  serve_stress mtp models/small-hybrid "$mml" long,storm,mixed,sigterm \
    '{"method":"mtp","num_speculative_tokens":3}' --token-lo 3 --token-hi 4000 --max-num-batched-tokens 1024
fi
if has ngram; then
  say "## ngram: $shape, n-gram drafts (k = 3), stress phases"
  if need_synth; then
    serve_stress ngram "$synth" 131072 long,storm,mixed,sigterm \
      '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":4}' --serve-arg=--skip-tokenizer-init \
      --prompt-period 64
  else
    status=1
  fi
fi
say "total $(elapsed) s of $deadline"
mkdir -p "$out"
cp "$summary" "$out/spec-summary.md"
tar -C "$logs" -czf "$out/spec-gpu.tar.gz" .
for d in "$logs"/*/; do
  [ -f "$d/stress.log" ] && grep -a "^FAIL\|^stress:" "$d/stress.log" | cut -c1-300 | head -30 | sed "s|^|[$(basename "$d")] |"
done
cat "$summary"
exit $status
