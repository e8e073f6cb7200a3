#!/bin/sh
# Installs the Debian packages krait needs to build and test, skipping those already present.
# Uses sudo when not run as root. Safe to run repeatedly.
set -eu
PKGS="build-essential cmake pkg-config libjansson-dev libcriterion-dev libmicrohttpd-dev libuv1-dev libpcre2-dev libutf8proc-dev libcurl4-openssl-dev python3"
missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0
echo "installing:$missing"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
