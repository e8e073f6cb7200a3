#!/bin/sh
# Checks the README's quick start the way a new user meets it: on a bare Debian 12 made by
# `debootstrap bookworm DIR` (no make, compiler, curl or sudo), with a fresh clone of this repository.
#   tools/check-bare-debian.sh DIR     (as root; DIR is created with debootstrap when it holds no system)
# Steps, each reported PASS or FAIL at the end:
#   a. root: `./bootstrap.sh serve` installs and builds krait alone; /health answers 200, the README's
#      curl example gets a chat completion, SIGTERM stops the server and everything exits 0.
#   b. root: `./bootstrap.sh test` (everything now present: it must call no apt-get) exits 0.
#   c. a user with sudo (NOPASSWD), curl removed beforehand: `./bootstrap.sh serve PORT=8001` installs
#      curl through sudo, serves, answers, stops on SIGTERM.
#   d. a user without sudo, make and sudo removed: `./bootstrap.sh serve` stops at once with the
#      "run as root or install sudo" message and calls no apt-get; no arguments prints the usage.
# Every apt-get call in the chroot is recorded by a wrapper, /usr/local/sbin/apt-get (first in root's
# and sudo's PATH), so the script can tell whether one happened. The chroot is kept; step d leaves it
# without make and sudo, so a rerun's step a installs them again. Logs: DIR/var/log/krait-check/.
# Needs on this machine: root, git, curl (to see whether the ports are free), debootstrap (installed
# with apt-get when missing). Environment: MIRROR (default http://deb.debian.org/debian), WAIT_S
# (how long to wait for a server to build and answer, default 3600).
set -eu

[ $# -eq 1 ] || { echo "usage: $0 CHROOT_DIR" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || { echo "$0: needs root (debootstrap, mount, chroot)" >&2; exit 2; }
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WAIT_S=${WAIT_S:-3600}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
case "$DIR" in
    /|"$REPO"|"$REPO"/*) echo "$0: the chroot must be outside the repository and not /" >&2; exit 2 ;;
esac
LOGS=$DIR/var/log/krait-check
APTLOG=/var/log/krait-check/apt-calls.log   # inside the chroot
ROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER_PATH=/usr/local/bin:/usr/bin:/bin      # Debian's default PATH for users
RESULTS=""

say() { echo "== $(date +%H:%M:%S) $*"; }
result() { RESULTS="$RESULTS$1 $2
"; say "$1 $2"; }

# Run a command in the chroot as root, or as a user (uid taken from the chroot's passwd), with a
# clean environment like a login's.
inroot() { chroot "$DIR" /usr/bin/env -i HOME=/root USER=root LOGNAME=root PATH=$ROOT_PATH LANG=C.UTF-8 "$@"; }
asuser() {
    _u=$1; shift
    _id=$(chroot "$DIR" id -u "$_u"):$(chroot "$DIR" id -g "$_u")
    chroot --userspec="$_id" "$DIR" /usr/bin/env -i HOME="/home/$_u" USER="$_u" LOGNAME="$_u" PATH="$USER_PATH" \
        LANG=C.UTF-8 "$@"
}
apt_calls() { cat "$DIR$APTLOG" 2>/dev/null || true; }

# The pids of krait processes running inside this chroot (their root is DIR).
krait_pids() {
    for _p in /proc/[0-9]*; do
        [ "$(cat "$_p/comm" 2>/dev/null)" = krait ] || continue
        [ "$(readlink "$_p/root" 2>/dev/null)" = "$DIR" ] && echo "${_p#/proc/}"
    done
    return 0
}

MOUNTED=""
cleanup() {
    for _p in $(krait_pids); do kill -TERM "$_p" 2>/dev/null || true; done
    sleep 1
    for _m in $MOUNTED; do umount "$DIR/$_m" 2>/dev/null || umount -l "$DIR/$_m" || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the bare system -------------------------------------------------------------------------
if [ -d "$DIR/debootstrap" ]; then
    echo "$0: $DIR holds an unfinished debootstrap; remove it and run again" >&2; exit 1
fi
if [ ! -f "$DIR/etc/debian_version" ]; then
    command -v debootstrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq debootstrap; }
    say "debootstrap bookworm $DIR $MIRROR"
    debootstrap bookworm "$DIR" "$MIRROR"
fi
grep -q '^12\.' "$DIR/etc/debian_version" || { echo "$0: $DIR is not Debian 12" >&2; exit 1; }
# /dev/pts too, or apt-get complains that it cannot write its log (the check passes without it)
for m in proc sys dev dev/pts; do
    if ! mountpoint -q "$DIR/$m"; then
        case $m in
            proc) mount -t proc proc "$DIR/proc" ;;
            sys) mount -t sysfs sysfs "$DIR/sys" ;;
            dev|dev/pts) mount --bind "/$m" "$DIR/$m" ;;
        esac
        MOUNTED="$m $MOUNTED"   # unmounted in reverse order
    fi
done
[ -s "$DIR/etc/resolv.conf" ] || cp /etc/resolv.conf "$DIR/etc/resolv.conf"
mkdir -p "$LOGS"
chmod 1777 "$LOGS"   # the users of steps c and d leave their logs here too

# the apt-get recorder: one line per call (uid, the sudo user if any, the arguments)
cat > "$DIR/usr/local/sbin/apt-get" <<'EOF'
#!/bin/sh
# tools/check-bare-debian.sh: records each apt-get call, then runs the real one
echo "uid=$(id -u) sudo_user=${SUDO_USER:-} apt-get $*" >> /var/log/krait-check/apt-calls.log 2>/dev/null || true
exec /usr/bin/apt-get "$@"
EOF
chmod 755 "$DIR/usr/local/sbin/apt-get"

say "chroot state before the steps:"
for c in make cc cmake curl python3 sudo; do
    printf '   %-8s %s\n' "$c" "$(inroot sh -c "command -v $c || echo missing")"
done

# A fresh clone of the committed HEAD for USER's home (root: /root).
clone_for() {
    _home=$DIR/root; [ "$1" = root ] || _home=$DIR/home/$1
    rm -rf "$_home/krait"
    git clone -q "$REPO" "$_home/krait"
    [ "$1" = root ] || chown -R "$(chroot "$DIR" id -u "$1"):$(chroot "$DIR" id -g "$1")" "$_home/krait"
}
say "repository: $REPO at $(git -C "$REPO" rev-parse --short HEAD) (uncommitted changes are not checked)"

port_free() { ! curl -s -o /dev/null --max-time 2 "localhost:$1/health"; }

# Serve in the background as WHO (root or a user name) on PORT with the extra ARGS, wait for /health,
# send the README's curl example (its port replaced), SIGTERM the server, expect exit 0 everywhere.
serve_check() {
    _who=$1 _port=$2 _log=$3; shift 3
    port_free "$_port" || { say "port $_port is already taken on this machine"; return 1; }
    if [ "$_who" = root ]; then
        inroot sh -c "cd /root/krait && exec ./bootstrap.sh serve $*" > "$_log" 2>&1 &
    else
        asuser "$_who" sh -c "cd ~/krait && exec ./bootstrap.sh serve $*" > "$_log" 2>&1 &
    fi
    _bg=$! _st0=$(date +%s) _code=""
    while :; do
        _code=$(inroot sh -c "command -v curl >/dev/null && curl -s -o /dev/null -w '%{http_code}' localhost:$_port/health" 2>/dev/null || true)
        [ "$_code" = 200 ] && break
        if ! kill -0 "$_bg" 2>/dev/null; then
            wait "$_bg" || true; say "the serve command ended before /health answered: tail of $_log"; tail -20 "$_log"; return 1
        fi
        if [ $(($(date +%s) - _st0)) -gt "$WAIT_S" ]; then say "no /health 200 after ${WAIT_S}s"; return 1; fi
        sleep 3
    done
    say "/health 200 after $(($(date +%s) - _st0))s"
    # the README's example, as written there, on this port
    _ex=$(sed -n '/^curl localhost:8000\/v1\/chat\/completions/,/^```/p' "$REPO/README.md" | sed '$d' |
        sed "s/localhost:8000/localhost:$_port/")
    [ -n "$_ex" ] || { say "README's curl example not found"; return 1; }
    _resp=$(inroot sh -c "$_ex" 2>"$_log.curl.err" || true)
    echo "$_resp" > "$_log.completion.json"
    echo "   response: $(echo "$_resp" | cut -c1-300)"
    echo "$_resp" | grep -q '"object": *"chat.completion"' || { say "no chat completion"; return 1; }
    echo "$_resp" | grep -q '"choices"' || { say "no choices"; return 1; }
    _k=$(krait_pids)
    [ -n "$_k" ] || { say "no krait process found in the chroot"; return 1; }
    say "SIGTERM to krait (pid $_k)"
    kill -TERM $_k
    _t=0
    while kill -0 "$_bg" 2>/dev/null && [ $_t -lt 60 ]; do sleep 1; _t=$((_t + 1)); done
    if kill -0 "$_bg" 2>/dev/null; then say "still running 60s after SIGTERM"; return 1; fi
    _src=0; wait "$_bg" || _src=$?
    say "the serve command exited $_src ${_t}s after SIGTERM"
    [ "$_src" -eq 0 ]
}

# ---- a. root: serve ---------------------------------------------------------------------------
step_a() {
    clone_for root || return 1
    : > "$DIR$APTLOG"
    _t0=$(date +%s)
    serve_check root 8000 "$LOGS/a-serve.log" || return 1
    say "step a took $(($(date +%s) - _t0))s; apt-get calls:"
    apt_calls | sed 's/^/   /'
    # only krait was built: no test or bench tree, no other executable
    _exe=$(cd "$DIR/root/krait/build" && find . -path '*/CMakeFiles' -prune -o -type f -perm -u+x -print)
    echo "   executables in build/: $_exe"
    [ "$_exe" = "./krait" ] || { say "serve built more than krait"; return 1; }
    grep -q '^KR_BUILD_TESTS:BOOL=OFF' "$DIR/root/krait/build/CMakeCache.txt" || return 1
    grep -q '^KR_BUILD_BENCH:BOOL=OFF' "$DIR/root/krait/build/CMakeCache.txt" || return 1
}

# ---- b. root: test, with everything present --------------------------------------------------
step_b() {
    : > "$DIR$APTLOG"
    _t0=$(date +%s) _rc=0
    inroot sh -c 'cd /root/krait && ./bootstrap.sh test' > "$LOGS/b-test.log" 2>&1 || _rc=$?
    say "./bootstrap.sh test exited $_rc after $(($(date +%s) - _t0))s (log: $LOGS/b-test.log)"
    grep -aE 'tests passed|tests failed out of|Total Test time|skipping' "$LOGS/b-test.log" | sed 's/^/   /'
    [ -z "$(apt_calls)" ] || { say "apt-get was called with everything present:"; apt_calls; return 1; }
    [ "$_rc" -eq 0 ]
}

# ---- c. a user with sudo ----------------------------------------------------------------------
step_c() {
    inroot sh -c 'command -v sudo >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sudo' \
        > "$LOGS/c-setup.log" 2>&1 || { say "could not install sudo: see $LOGS/c-setup.log"; return 1; }
    inroot sh -c 'id kdev >/dev/null 2>&1 || useradd -m -s /bin/sh kdev' || return 1
    echo 'kdev ALL=(ALL) NOPASSWD: ALL' > "$DIR/etc/sudoers.d/kdev"
    chmod 440 "$DIR/etc/sudoers.d/kdev"
    # take one package away so that the user's run has to install it through sudo
    inroot sh -c 'DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq curl' >> "$LOGS/c-setup.log" 2>&1 ||
        { say "could not remove curl: see $LOGS/c-setup.log"; return 1; }
    clone_for kdev || return 1
    : > "$DIR$APTLOG"
    _t0=$(date +%s)
    serve_check kdev 8001 "$LOGS/c-serve.log" PORT=8001 || return 1
    say "step c took $(($(date +%s) - _t0))s; apt-get calls:"
    apt_calls | sed 's/^/   /'
    apt_calls | grep -q '^uid=0 sudo_user=kdev apt-get install .*curl' || { say "curl was not installed through sudo"; return 1; }
    [ "$(stat -c %u "$DIR/home/kdev/krait/build/krait")" = "$(chroot "$DIR" id -u kdev)" ] ||
        { say "build/krait is not owned by kdev"; return 1; }
}

# ---- d. a user without sudo, make missing ------------------------------------------------------
step_d() {
    # (sudo's pre-removal script refuses when root has no password, unless SUDO_FORCE_REMOVE=yes)
    inroot sh -c 'DEBIAN_FRONTEND=noninteractive SUDO_FORCE_REMOVE=yes apt-get remove -y -qq sudo make' \
        > "$LOGS/d-setup.log" 2>&1 || { say "could not remove sudo and make: see $LOGS/d-setup.log"; return 1; }
    inroot sh -c 'id knosudo >/dev/null 2>&1 || useradd -m -s /bin/sh knosudo' || return 1
    clone_for knosudo || return 1
    inroot sh -c '! command -v make && ! command -v sudo' >/dev/null || { say "make or sudo still there"; return 1; }
    : > "$DIR$APTLOG"
    _rc=0
    asuser knosudo sh -c 'cd ~/krait && ./bootstrap.sh serve' > "$LOGS/d-nosudo.log" 2>&1 || _rc=$?
    say "./bootstrap.sh serve as a user without sudo exited $_rc:"
    sed 's/^/   /' "$LOGS/d-nosudo.log"
    [ "$_rc" -ne 0 ] || return 1
    grep -q 'run this again as root, or install sudo' "$LOGS/d-nosudo.log" || return 1
    [ -z "$(apt_calls)" ] || { say "apt-get was called"; return 1; }
    [ ! -e "$DIR/home/knosudo/krait/build" ] || { say "something was built"; return 1; }
    _rc=0
    asuser knosudo sh -c 'cd ~/krait && ./bootstrap.sh' > "$LOGS/d-usage.log" 2>&1 || _rc=$?
    say "./bootstrap.sh without arguments exited $_rc: $(cat "$LOGS/d-usage.log")"
    [ "$_rc" -eq 2 ] && grep -q '^usage:' "$LOGS/d-usage.log"
}

for s in a b c d; do
    say "---- step $s"
    if step_$s; then result PASS "step $s"; else result FAIL "step $s"; fi
done

echo
echo "== summary (chroot $DIR, logs in $LOGS)"
printf '%s' "$RESULTS"
case "$RESULTS" in
    *FAIL*) echo "== FAIL"; exit 1 ;;
    *) echo "== PASS"; exit 0 ;;
esac
