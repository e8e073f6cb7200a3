#!/bin/sh
# The README's quick start, from a bare Debian 12:
#   ./bootstrap.sh serve [VAR=value ...]   install what is missing, build krait, serve the embedded default model
#   ./bootstrap.sh test  [VAR=value ...]   install what is missing, build under ASan+UBSan, run every test
# Missing packages (tools/install-deps.sh holds the list, make and the compiler among them) are
# installed with apt-get, as root or through sudo; then it runs `make serve` or `make test`, passing
# the extra arguments (PORT=8001, JOBS=4, MODEL=DIR ...) to make.
set -eu
usage() {
    echo "usage: $0 serve|test [make variables, e.g. PORT=8001]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
case "$1" in
    serve|test) ;;
    *) usage ;;
esac
cd "$(dirname "$0")"
./tools/install-deps.sh
exec make "$@"
