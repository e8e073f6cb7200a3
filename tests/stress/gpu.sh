#!/usr/bin/env bash
# The serving stress suite on a GPU machine, on synthetic 8B checkpoints with a 128K context, in one
# call that keeps within a deadline. For each shape (default nemotron_h_8b, then hybrid_dsa_8b):
#   1. the checkpoint: tools/bench/synth_model.py make --shape S --max-pos 131072 (kept and reused
#      when it already verifies; its config.json is checked for max_position_embeddings);
#   2. tests/stress/stress.py --profile gpu on `krait serve DIR --max-model-len 131072
#      --skip-tokenizer-init` (the checkpoints have no tokenizer): long prompts up to 131072 tokens,
#      the disconnect storm, mixed traffic, then the serving figures at concurrency 1, 16, 64, 256
#      with 1024 input / 256 output tokens (its bench phase), then SIGTERM under load;
#   3. bench_cuda's offline figures of the same checkpoint for comparison (decode at batch 1, 16,
#      64, 256 at context 1152, the serving run's mean; prefill of 1024 tokens).
# Logs and summaries go to $OUT (or ./stress-gpu-out) as one archive, stress-gpu.tar.gz, plus
# summary.md. A stage that would start with under 20 s left is skipped, saying so; each shape gets
# at most an even share of what is left; the archive is written even when a stage is cut.
#
#   tests/stress/gpu.sh [--build DIR] [--deadline SECONDS] [--shapes "nemotron_h_8b hybrid_dsa_8b"]
#                       [--synth-root DIR] [--max-model-len N] [--phases LIST] [--stress-args "..."]
#   tests/stress/gpu.sh --pack [BUILD [DEST]]
#
# --build: a CUDA build (default build-gpu) holding krait and bench/bench_cuda, with devlibs/ beside
# them when the GPU machine lacks their shared libraries. --pack (on the build machine) copies
# BUILD's krait and bench_cuda (default build-gpu) and the shared libraries they load, except the C
# runtime and CUDA's, into DEST (default build-stress-gpu) for --build DEST there.
# --deadline: the whole run's seconds (default 560). --phases: stress.py's (default
# long,storm,mixed,bench,sigterm). The exit status is 1 when a stage failed or was cut.
set -u
if [ "${1:-}" = --pack ]; then
  src=${2:-build-gpu} dst=${3:-build-stress-gpu}
  mkdir -p "$dst/bench" "$dst/devlibs"
  cp "$src/krait" "$dst/" && cp "$src/bench/bench_cuda" "$dst/bench/" || exit 1
  strip "$dst/krait" "$dst/bench/bench_cuda" 2>/dev/null
  ldd "$dst/krait" "$dst/bench/bench_cuda" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas[^/]*|libnccl|libnvidia[^/]*)\.so' |
    while read -r lib; do cp -L "$lib" "$dst/devlibs/"; done
  du -sh "$dst"
  exit 0
fi
build=build-gpu deadline=560 shapes="nemotron_h_8b hybrid_dsa_8b" root=/tmp mml=131072
phases=long,storm,mixed,bench,sigterm stress_args=""
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    --shapes) shapes=$2; shift ;;
    --synth-root) root=$2; shift ;;
    --max-model-len) mml=$2; shift ;;
    --phases) phases=$2; shift ;;
    --stress-args) stress_args=$2; shift ;;
    *) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
t_start=$(date +%s)
# shellcheck source=tests/gpu/deadline.sh
. "$(dirname "$0")/../gpu/deadline.sh"
out=${OUT:-$PWD/stress-gpu-out}
logs=$(mktemp -d)
summary=$logs/summary.md
export LD_LIBRARY_PATH=$PWD/$build/devlibs:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
status=0
say() { echo "$*"; echo "$*" >> "$summary"; }
{
  echo "# Serving stress on the GPU, $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/device: /'
  echo "build: $build; shapes: $shapes; --max-model-len $mml; deadline $deadline s"
  echo
} > "$summary"
for b in "$build/krait" "$build/bench/bench_cuda"; do
  [ -x "$b" ] || say "missing $b"
done
shapes_left=$(echo "$shapes" | wc -w)
for shape in $shapes; do
  dir=$root/krait-stress-$shape
  sl=$logs/$shape
  mkdir -p "$sl"
  share=$(( (deadline - $(elapsed)) / shapes_left ))
  shapes_left=$(( shapes_left - 1 ))
  t_shape=$(date +%s)
  say "## $shape ($share s of the deadline)"
  # 1. the checkpoint
  b=$(left 240)
  if [ "$b" = 0 ]; then
    say "skipped: deadline reached before the checkpoint"; status=1; continue
  fi
  s=$(date +%s)
  timeout "$b" python3 tools/bench/synth_model.py make --shape "$shape" --out "$dir" --max-pos "$mml" --skip-existing \
    > "$sl/synth.log" 2>&1
  rc=$?
  say "checkpoint: rc=$rc in $(( $(date +%s) - s )) s ($(tail -1 "$sl/synth.log" | cut -c1-160))"
  if [ $rc != 0 ] || [ ! -f "$dir/config.json" ]; then
    say "no checkpoint: skipping $shape (see $shape/synth.log)"; status=1; continue
  fi
  mp=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('max_position_embeddings', 0))" "$dir/config.json")
  if [ "${mp:-0}" -lt "$mml" ]; then
    # synth_model.py has --max-pos; should a checkpoint still say less, raise it here
    python3 - "$dir/config.json" "$mml" <<'EOF'
import json, sys
p, n = sys.argv[1], int(sys.argv[2])
c = json.load(open(p))
c["max_position_embeddings"] = n
json.dump(c, open(p, "w"), indent=2)
EOF
    say "config.json had max_position_embeddings $mp: raised to $mml"
  fi
  # 2. the stress phases and the serving figures; stress.py keeps to its own deadline (the offline
  # figures keep 50 s of this shape's share: they took 17-19 s on an H200)
  sb=$(( share - ($(date +%s) - t_shape) - 50 ))
  b=$(left $(( sb > 0 ? sb : 0 )))
  if [ "$b" = 0 ] || [ "$b" -lt 60 ]; then
    say "stress: skipped, ${b} s left for it"; status=1
  else
    s=$(date +%s)
    # shellcheck disable=SC2086
    timeout $(( b + 30 )) python3 tests/stress/stress.py --profile gpu --krait "$build/krait" --model "$dir" \
      --max-model-len "$mml" --serve-arg=--skip-tokenizer-init --phases "$phases" --deadline "$b" --out "$sl" \
      $stress_args > "$sl/stress.log" 2>&1
    rc=$?
    [ $rc != 0 ] && status=1
    # a server left behind (the suite cut by the timeout) would hold the GPU: end it by its pid
    pid=$(cat "$sl/server.pid" 2>/dev/null)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q krait "/proc/$pid/cmdline" 2>/dev/null; then
      kill -9 "$pid"; say "stress: its server $pid was still running: killed"
    fi
    say "stress: rc=$rc in $(( $(date +%s) - s )) s"
    { echo; sed -n '/^| phase |/,$p' "$sl/stress.log"; echo; } >> "$summary"
    grep -a "^  \[" "$sl/stress.log" | cut -c1-400 > "$sl/notes.txt"
  fi
  # 3. offline figures of the same checkpoint
  b=$(left 120)
  if [ "$b" = 0 ]; then
    say "bench_cuda: skipped, deadline reached"; status=1
  else
    s=$(date +%s)
    timeout "$b" "$build/bench/bench_cuda" --batches 1,16,64,256 --prefill 1024 --ctx 1152 --steps 32 \
      --json "$sl/bench_cuda.jsonl" "$dir" > "$sl/bench_cuda.md" 2>&1
    rc=$?
    [ $rc != 0 ] && status=1
    say "bench_cuda (offline, no HTTP): rc=$rc in $(( $(date +%s) - s )) s"
    { echo; grep -a '^|\|^device\|^model\|^cache' "$sl/bench_cuda.md"; echo; } >> "$summary"
  fi
done
say "total $(elapsed) s of $deadline"
mkdir -p "$out"
cp "$summary" "$out/summary.md"
tar -C "$logs" -czf "$out/stress-gpu.tar.gz" .
for shape in $shapes; do
  [ -f "$logs/$shape/stress.log" ] && grep -a "^FAIL\|^stress:" "$logs/$shape/stress.log" | cut -c1-300 | head -30 |
    sed "s/^/[$shape] /"
done
cat "$summary"
exit $status
