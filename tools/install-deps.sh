#!/bin/sh
# Installs the Debian packages krait needs to build, test and try out (curl for the README's
# example), skipping those already present: when nothing is missing it exits without calling
# apt-get. Runs apt-get directly as root, through sudo otherwise, and stops with a message when
# neither is possible. Needs only sh and dpkg, so it runs before make exists. Safe to run repeatedly.
# Arguments name further packages a single test needs (make test-megatron: python3-torch), so that
# serving never pulls them.
set -eu
PKGS="build-essential cmake pkg-config libjansson-dev libcriterion-dev libmicrohttpd-dev libuv1-dev libpcre2-dev libutf8proc-dev libsodium-dev libcurl4-openssl-dev python3 curl $*"
missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-deps: apt-get not found (krait's installer targets Debian 12); install these packages yourself:$missing" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "install-deps: these Debian packages are missing:$missing" >&2
        echo "install-deps: installing them needs root, and sudo is not installed: run this again as root, or install sudo (as root: apt-get install sudo) and give your user sudo rights." >&2
        exit 1
    fi
    SUDO="sudo"
fi
echo "installing:$missing"
$SUDO apt-get update -qq
# env, not a plain assignment: sudo resets the environment and would drop DEBIAN_FRONTEND
# $missing unquoted on purpose: one word per package
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
