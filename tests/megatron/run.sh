#!/bin/sh
# Round trip of the Megatron converter (tests/megatron/roundtrip.py) with the first Python that
# imports torch: $PYTHON, python3, then Debian's /usr/bin/python3 (apt-get install python3-torch).
#   tests/megatron/run.sh [KRAIT_BIN] [roundtrip.py options]      (KRAIT_BIN default: build-test/krait)
set -e
cd "$(dirname "$0")/../.."
krait=build-test/krait
case "${1:-}" in -*|"") ;; *) krait=$1; shift ;; esac
for py in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import torch' 2>/dev/null; then
        exec "$py" tests/megatron/roundtrip.py --krait "$krait" "$@"
    fi
done
echo "run.sh: no Python with torch found (set PYTHON, or apt-get install python3-torch)" >&2
exit 1
