#!/usr/bin/env bash
# Serves a checkpoint with `krait serve` and sends long prompts through it, one after another and
# then several at once (with n = 2), printing one line per request and whether /health still tells
# the truth afterwards. The check for "every prompt length up to max_model_len works through the
# server" on a GPU machine.
#   tests/gpu/serve-long.sh KRAIT MODEL_DIR MAX_MODEL_LEN LOG LEN [LEN...] [-- SERVE_FLAGS...]
# Exit status: 0 when every request got a complete answer and the server stayed healthy.
set -u
krait=$1 model=$2 maxlen=$3 log=$4
shift 4
lens=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do lens+=("$1"); shift; done
[ $# -gt 0 ] && shift
pf=$(mktemp)
rm -f "$pf"
"$krait" serve "$model" --port 0 --port-file "$pf" --max-model-len "$maxlen" --skip-tokenizer-init --log-level info "$@" \
  > "$log" 2>&1 &
pid=$!
python3 - "$pf" "$pid" "$maxlen" "${lens[@]}" <<'EOF'
import json, os, random, socket, sys, threading, time
pf, pid, maxlen, lens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4:]]
t0 = time.time()
while not (os.path.exists(pf) and open(pf).read().strip()):
    if time.time() - t0 > 300:
        print("serve-long: no port after 300 s"); sys.exit(1)
    try:
        os.kill(pid, 0)
    except OSError:
        print("serve-long: krait serve exited at start-up"); sys.exit(1)
    time.sleep(0.2)
port = int(open(pf).read())

def http(method, path, body=None, timeout=600):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    data = json.dumps(body).encode() if body is not None else b""
    s.sendall(f"{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    raw = b""
    while True:
        x = s.recv(1 << 20)
        if not x:
            break
        raw += x
    s.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/") else 0
    return status, payload

while True:
    try:
        if http("GET", "/health", timeout=5)[0] == 200:
            break
    except OSError:
        pass
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    if state in ("Z", "X", "gone"):
        print("serve-long: krait serve exited while loading"); sys.exit(1)
    if time.time() - t0 > 900:
        print("serve-long: not healthy after 900 s"); sys.exit(1)
    time.sleep(0.5)
print(f"serve-long: healthy after {time.time() - t0:.1f} s")
fails = 0
rng = random.Random(1)

def one(n, k, tag, out):
    ids = [rng.randrange(10, 30000) for _ in range(n)]
    t = time.time()
    try:
        st, payload = http("POST", "/v1/completions", {"prompt": ids, "max_tokens": 4, "n": k, "ignore_eos": True})
    except OSError as e:
        st, payload = 0, repr(e).encode()
    dt = time.time() - t
    ok = st == 200
    if ok:
        j = json.loads(payload)
        ok = len(j["choices"]) == k and all(c["finish_reason"] == "length" for c in j["choices"]) and \
            j["usage"]["prompt_tokens"] == n
    out.append((tag, n, k, st, dt, ok, payload[:300].decode("utf-8", "replace")))

def report(rows):
    global fails
    for tag, n, k, st, dt, ok, p in rows:
        print(f"{tag:8s} prompt={n:7d} n={k} status={st} {dt:7.2f}s {'ok' if ok else 'FAIL ' + p}")
        fails += not ok

for n in lens:
    rows = []
    one(n, 1, "alone", rows)
    report(rows)
# several at once: every length together, the longest with n = 2
rows, ths = [], []
for i, n in enumerate(lens):
    ths.append(threading.Thread(target=one, args=(min(n, maxlen - 8), 2 if i == len(lens) - 1 else 1, "together", rows)))
for t in ths:
    t.start()
for t in ths:
    t.join()
report(rows)
st, _ = http("GET", "/health", timeout=10)
print(f"health after: {st}")
st2, _ = http("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
print(f"a short request after: {st2}")
sys.exit(1 if fails or st != 200 or st2 != 200 else 0)
EOF
rc=$?
kill -TERM "$pid" 2>/dev/null
wait "$pid"
echo "serve-long: krait serve exited $?"
rm -f "$pf"
exit $rc
