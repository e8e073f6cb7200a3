#!/bin/sh
# Checks the CPU image without docker: executes deploy/Dockerfile.cpu's stages, instruction by
# instruction, in Debian 12 roots made with `debootstrap --variant=minbase bookworm` (what the
# debian:12 images are made from), then starts the final stage's ENTRYPOINT + CMD as its USER on a
# read-only root with a tmpfs /tmp (as deploy/kubernetes runs it), asks it for a chat completion
# with curl, sends SIGTERM and expects exit status 0.
#   deploy/check-image.sh DIR [DOCKERFILE]    (as root; DIR holds the roots and is reused)
# Needs root, python3, curl and Debian's mirror (MIRROR, default http://deb.debian.org/debian);
# debootstrap is installed with apt-get when missing. Takes minutes (the stages build krait).
# The instructions run are deploy/dockerfile-chroot.py's subset of Dockerfile syntax.
set -eu

if [ $# -lt 1 ] || [ $# -gt 2 ]; then echo "usage: $0 DIR [DOCKERFILE]" >&2; exit 2; fi
[ "$(id -u)" -eq 0 ] || { echo "$0: needs root (debootstrap, mount, chroot)" >&2; exit 2; }
MIRROR=${MIRROR:-http://deb.debian.org/debian}
REPO=$(cd "$(dirname "$0")/.." && pwd)
DOCKERFILE=${2:-$REPO/deploy/Dockerfile.cpu}
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
case "$DIR" in
    /|"$REPO"|"$REPO"/*) echo "$0: DIR must be outside the repository and not /" >&2; exit 2 ;;
esac

# One debootstrap; every stage starts from a copy of it.
BASE=$DIR/base
if [ -d "$BASE/debootstrap" ]; then
    echo "$0: $BASE holds an unfinished debootstrap; remove it and run again" >&2; exit 1
fi
if [ ! -f "$BASE/etc/debian_version" ]; then
    command -v debootstrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq debootstrap; }
    echo "== debootstrap --variant=minbase bookworm $BASE $MIRROR"
    debootstrap --variant=minbase bookworm "$BASE" "$MIRROR"
    # what the debian:12 images carry too: no documentation, and apt's lists cleaned by each RUN
    rm -rf "$BASE/var/lib/apt/lists/"*
fi
grep -q '^12\.' "$BASE/etc/debian_version" || { echo "$0: $BASE is not Debian 12" >&2; exit 1; }

exec python3 "$REPO/deploy/dockerfile-chroot.py" --base "$BASE" --work "$DIR" --context "$REPO" "$DOCKERFILE"
