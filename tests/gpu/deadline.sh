# shellcheck shell=bash disable=SC2154
# Time budget of the GPU scripts (run.sh, invariant.sh, spec.sh, stream.sh, tests/stress/gpu.sh),
# sourced after they set `deadline` (the whole run's seconds) and `t_start` (date +%s at its start).
# seconds since the start
elapsed() { echo $(( $(date +%s) - t_start )); }
# seconds a stage may take: at most $1 and at most what is left of the deadline; 0 when under 20 s
# are left
left() {
  local r=$(( deadline - $(elapsed) ))
  [ "$r" -lt 20 ] && { echo 0; return; }
  [ "$r" -gt "$1" ] && r=$1
  echo "$r"
}
# runs "$@" under timeout with a budget of at most $1 seconds; skipped (rc 125) past the deadline
run_for() {
  local b; b=$(left "$1"); shift
  [ "$b" = 0 ] && { echo "skipped: deadline reached"; return 125; }
  timeout "$b" "$@"
}
